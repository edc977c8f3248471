"""Image datasets on the nodes: formats (folders, CIFAR, tar shards, packed shards),
readers, decoding, augmentation and the batches fed to the trainer."""
