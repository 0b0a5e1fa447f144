"""What the benchmark scripts share beyond ``train_bench.py``'s workloads and timing loop."""
