"""Load generator and side-by-side comparison runs of servelm against peer servers.

`bench.loadgen` drives any OpenAI-compatible server; `bench.llama_server` builds llama.cpp's own
`llama-server` from the llama.cpp source that llama-cpp-python vendors; `bench.compare` runs the
workloads against each server in turn and prints the ratios. See bench/README.md.
"""
