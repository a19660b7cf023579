"""Checkpoint core: layout, manifest, atomic writer, verified reader, retention."""
