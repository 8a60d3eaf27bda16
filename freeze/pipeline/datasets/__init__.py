"""The datasets this pipeline generates (a leaf: it imports no driver): the FDSL-32 substrate
(fdsl), the planted-boundary tasks (planted), the synthetic tasks (synthetic), the committed
pretrained weights they are read with (weights), and the one image normalization (images).
freeze.pipeline.data registers them beside CIFAR-10."""
