"""The model registry: what users touch most after a run (which model serves, how every run
scored and what was decided, whether a new run has anything to do, a model copied out, a run's
outputs opened in a browser).

Everything it keeps lives in the output container below ``output.prefix``; ``layout`` is the
one place that names those blobs. It sits above ``backends`` (it scores models as tasks on a
cluster and reads Blob storage through the clients there) and below ``tasks`` and ``flows``.
"""
