"""`sparrow.bench`: the benchmark wing — harnesses behind `sparrow bench`, the scripts that record results
under `benchmarks/results/`, and the fuzzers. Product packages never import it."""
