"""The lowest layer: temp names (one builder and parser), the hashing writer and fsyncs, and
publishing a staged directory into place. Imports nothing of the project but `system`/`errors`."""
