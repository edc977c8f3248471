"""How users start the pipeline: work pool setup, the Event Grid relay, the polling sensor."""
