"""Temporary device probe (deleted after tuning): chunk-size sweep + a profiler trace."""

import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from raykv import ops
from raykv.bench import copy as C

d = torch.device("cuda")
out = os.environ.get("OUT", ".")
for lay, counts in ((C.LLAMA3_8B_B16, (256, 1024)), (C.LLAMA3_8B_B128, (256,))):
    p = C._Pool(lay, max(counts), d)
    for n in counts:
        ids = torch.randperm(p.num_blocks, generator=torch.Generator().manual_seed(0))[:n]
        for th in (True, False):
            m = C._methods(p, ids, th)
            c = C._time_ms(m["contiguous"], d, 2, 9)
            r = []
            for sb in (32, 64, 128, 256):
                for fb in (2, 4):
                    ops._STAGING_BYTES, ops._FIRST_CHUNK_BYTES = sb << 20, fb << 20
                    r.append(f"{sb}/{fb}:{c / C._time_ms(m['raykv'], d, 2, 9):.3f}")
            c2 = C._time_ms(m["contiguous"], d, 2, 9)
            print(lay.name, n, "d2h" if th else "h2d", f"contig {c:.3f}/{c2:.3f} ms", *r)
            sys.stdout.flush()
            if n == 1024:
                ops._STAGING_BYTES, ops._FIRST_CHUNK_BYTES = 64 << 20, 4 << 20
                m["raykv"]()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    m["raykv"]()
                    torch.cuda.synchronize()
                prof.export_chrome_trace(f"{out}/trace_{'d2h' if th else 'h2d'}.json")
    del p, m
    torch.cuda.empty_cache()
