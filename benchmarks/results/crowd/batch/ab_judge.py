import sys, statistics
root = sys.argv[1]
sys.path.insert(0, root + "/benchmarks"); sys.path.insert(0, root)
import bench_validation_cost as b
import p2p_diloco.sync.sponsorship as sp
assert sp.__file__.startswith(root), sp.__file__
tot, end = b.judging_round_s(120576, 64, 15)
print(root, f"total {tot*1e3:.2f} ms  at end {end*1e3:.2f} ms")
