"""placeholder"""
def add_bench_args(p):
    pass
