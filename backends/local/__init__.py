"""The local target's stand-ins: the cluster of local nodes, Azurite, buildah,
the local image registry, and the process and port helpers they share."""
