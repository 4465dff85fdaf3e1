"""`sparrow bench kernels`: the decode attention kernels' achieved bandwidth against the copy ceiling, beside
torch SDPA and FlashInfer (`measure.py` says what is timed and how)."""
