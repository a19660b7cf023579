"""Payload formats a checkpoint directory can hold besides one `state.pt`: chunked (one
process's state in size-bounded files + index.json), torch-dcp (one checkpoint written by
every rank with torch.distributed.checkpoint) and the seed `step_NNNNNN.bin`."""
