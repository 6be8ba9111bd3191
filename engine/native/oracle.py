"""The noisy ORACLE drafter as one libkdtree kernel (kdt_oracle_draft, CPU and CUDA).

`NativeOracleDrafter` is engine.drafters.oracle.OracleDrafter (same truths table, same
constants) whose draft_batch is the native kernel instead of ~80 small torch ops: the oracle's
rows in the benchmarks then measure the decode round, not the drafter's launch overhead. The
torch draft_batch stays the reference; tests check the kernel against it bit for bit.
"""

from __future__ import annotations

import numpy as np

from engine.drafters.oracle import OracleDrafter

from ._lib import Call, library


class NativeOracleDrafter(OracleDrafter):
    def draft_batch(self, inp, k: int):
        V, L = self.vocab_size, self.depth
        K = min(int(k), V)
        B = int(inp.rows.shape[0])
        S, T = (int(x) for x in self.table.shape)
        device = "cuda" if self.table.device.type == "cuda" else "cpu"
        c = Call(library(), "kdt_oracle_draft", device)
        ins = [c.input("table", self.table, np.int64, (S, T)),
               c.input("seeds", self.seeds, np.int64, (S,)),
               c.input("rows", inp.rows, np.int64, (B,)),
               c.input("lengths", inp.lengths, np.int64, (B,))]
        outs = [c.output("top_logp", np.float32, (B, L, K)),
                c.output("top_ids", np.int64, (B, L, K))]
        k_ = self.constants()
        r = c.run(c.backend, c.stream, B, L, K, V, k_["quality"], k_["q_mid"], k_["log_p0"],
                  k_["rest_c"], k_["spread"], ins[0], S, T, *ins[1:], *outs)
        return r["top_logp"], r["top_ids"]
