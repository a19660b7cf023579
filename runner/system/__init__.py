"""Facts about this process and its OS (descriptor limits, pid liveness); imports nothing above
`errors`."""
