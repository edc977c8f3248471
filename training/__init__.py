"""Code that runs on the cluster nodes: trainer, scorer, models and data formats.

Nothing here imports Prefect or Azure: the package is copied to the nodes as-is and must run
under plain ``horovodrun`` as well as in a single process.
"""
