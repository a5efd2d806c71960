"""The FUSE side: the pyfuse3 adapter, attributes, the control directory, checkpoint views, the C fast path."""
