"""The reliability suite's shared parts: the fault-injecting proxy and the report it writes."""
