"""Blob -> NFS staging, the node side: the sync (:mod:`staging.sync`), its transfer engine
(:mod:`staging.transfer`), the data gate's pinned listing (:mod:`staging.listing`), the clients
it reads with (:mod:`staging.blob`) and the Batch staging task (``python -m staging.task``).

Runs on a pool node as well as on the orchestrator's machine (the local target): it imports
nothing of the orchestrator (flows, tasks, deployments, backends), only the node-side
``training`` helpers it shares with the trainer.
"""
