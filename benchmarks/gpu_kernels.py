"""GPU check for the target kernels: run the kernel tests on CUDA, then time each Triton
kernel against its PyTorch reference over realistic shapes, side by side in one run.

    python benchmarks/gpu_kernels.py            # on a CUDA machine, < 5 minutes
    python benchmarks/gpu_kernels.py --no-tests # timings only
    python benchmarks/gpu_kernels.py --cpu-smoke  # tiny shapes, Triton interpreter (checks this script)

Needs only PyTorch, Triton and pytest. Without CUDA (and without --cpu-smoke) it says so
and exits 0. Shapes: Gemma 3 270M (4 query heads, 1 kv head, head_dim 256) and a
Llama-8B-like layer (32 / 8 / 128), bf16, in decode, prefill-chunk and tree-verify
batches, plus the FP8 KV cache, the KV store and tree acceptance. Every row also reports
the largest difference between the two outputs.
"""

from __future__ import annotations

import os
import sys

SMOKE = "--cpu-smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported

import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.target.kernels import get_kernels  # noqa: E402

MODELS = {"gemma3-270m": (4, 1, 256), "llama-8b-like": (32, 8, 128)}  # heads, kv heads, head_dim


def main() -> int:
    if not torch.cuda.is_available() and not SMOKE:
        print("gpu_kernels: no CUDA device here; nothing to check (run this on a CUDA machine). Exiting 0.")
        return 0
    device = "cpu" if SMOKE else "cuda"
    started = time.time()
    tests_ok = True
    if "--no-tests" not in sys.argv and not SMOKE:
        tests_ok = run_kernel_tests()
    ref, tri = get_kernels("reference"), get_kernels("triton")
    rows = []
    for model, (heads, kv_heads, head_dim) in MODELS.items():
        rows += bench_attention(ref, tri, model, heads, kv_heads, head_dim, device)
    rows += bench_store(ref, tri, device)
    rows += bench_accept(ref, tri, device)
    print_table(rows)
    print(f"\ntotal {time.time() - started:.0f} s; kernel tests {'passed' if tests_ok else 'FAILED'}")
    return 0 if tests_ok else 1


def run_kernel_tests() -> bool:
    """pytest tests/kernels with compiled (not interpreted) Triton kernels on this GPU."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "-q", "-p", "no:cacheprovider"]
    print("$ TRITON_INTERPRET=0 " + " ".join(cmd[1:]), flush=True)
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=210)
    except subprocess.TimeoutExpired:
        print("kernel tests timed out after 210 s")
        return False
    out = (proc.stdout + proc.stderr).strip().splitlines()
    print("\n".join(out[-25:] if proc.returncode else out[-1:]))
    print(f"kernel tests: {'ok' if proc.returncode == 0 else 'FAILED'} in {time.time() - t0:.0f} s\n", flush=True)
    return proc.returncode == 0


# ------------------------------------------------------------------ timing

def timed(fn, device: str) -> float:
    """Median milliseconds per call (CUDA events on GPU; wall clock under --cpu-smoke)."""
    fn()
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=5, rep=40, return_mode="median"))


def paged_batch(q_lens, ctx_lens, heads, kv_heads, head_dim, device, block_size=16, fp8=False, tree_nodes=0):
    """A paged batch with shuffled blocks; tree_nodes > 0 adds a binary-tree mask per sequence."""
    g = torch.Generator().manual_seed(0)
    kv_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    need = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(need) + 8
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros((len(q_lens), max(need)), dtype=torch.int32)
    used = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[used: used + n].int()
        used += n
    dtype = torch.bfloat16
    k = torch.randn((num_blocks, block_size, kv_heads, head_dim), generator=g).to(dtype)
    v = torch.randn((num_blocks, block_size, kv_heads, head_dim), generator=g).to(dtype)
    scales = {}
    if fp8:
        scales = {"k_scale": torch.full(k.shape[:3], 0.01).to(device), "v_scale": torch.full(k.shape[:3], 0.01).to(device)}
        k, v = (k * 100).to(torch.float8_e4m3fn), (v * 100).to(torch.float8_e4m3fn)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    tree_mask = None
    if tree_nodes:
        parents = [-1] + [(i - 1) // 2 for i in range(1, tree_nodes)]
        depth = [0] * tree_nodes
        anc = torch.eye(tree_nodes, dtype=torch.bool)
        for i in range(1, tree_nodes):
            depth[i] = depth[parents[i]] + 1
            anc[i] |= anc[parents[i]]
        tree_mask = anc.repeat(len(q_lens), 1)
        positions = torch.cat([torch.tensor(depth) + c for c in ctx_lens]).int()
    else:
        positions = torch.cat([torch.arange(c, c + q) for c, q in zip(ctx_lens, q_lens)]).int()
    query = torch.randn((int(qsl[-1]), heads, head_dim), generator=g).to(dtype)
    to = lambda t: t.to(device) if t is not None else None  # noqa: E731
    return dict(query=to(query), k_cache=to(k), v_cache=to(v), block_tables=to(tables),
                context_lens=to(torch.tensor(ctx_lens, dtype=torch.int32)), query_start_loc=to(qsl),
                query_positions=to(positions), scale=head_dim**-0.5, tree_mask=to(tree_mask), **scales)


def bench_attention(ref, tri, model, heads, kv_heads, head_dim, device):
    small = device != "cuda"
    n, ctx, chunk = (2, 40, 8) if small else (64, 2048, 512)
    cases = {
        f"decode {n}x1 ctx {ctx}": dict(q_lens=[1] * n, ctx_lens=[ctx] * n),
        f"prefill {max(n // 16, 1)}x{chunk} ctx {ctx // 4}": dict(q_lens=[chunk] * max(n // 16, 1), ctx_lens=[ctx // 4] * max(n // 16, 1)),
        f"tree {n // 2}x15 ctx {ctx}": dict(q_lens=[15] * (n // 2), ctx_lens=[ctx] * (n // 2), tree_nodes=15),
        f"decode {n}x1 ctx {ctx} fp8": dict(q_lens=[1] * n, ctx_lens=[ctx] * n, fp8=True),
    }
    rows = []
    for name, spec in cases.items():
        args = paged_batch(heads=heads, kv_heads=kv_heads, head_dim=head_dim, device=device, **spec)
        windows = [None, 512 if not small else 16] if "decode" in name and "fp8" not in name else [None]
        for window in windows:
            a = ref.paged_attention(**args, sliding_window=window)
            b = tri.paged_attention(**args, sliding_window=window)
            diff = (a.float() - b.float()).abs().max().item()
            label = f"{model} {name}" + (f" window {window}" if window else "")
            rows.append(("paged_attention", label, timed(lambda: ref.paged_attention(**args, sliding_window=window), device),
                         timed(lambda: tri.paged_attention(**args, sliding_window=window), device), diff))
    return rows


def bench_store(ref, tri, device):
    rows = []
    num_tokens = 64 if device != "cuda" else 8192
    for (kv_heads, head_dim), fp8 in [((1, 256), False), ((8, 128), False), ((8, 128), True)]:
        g = torch.Generator().manual_seed(1)
        key = torch.randn((num_tokens, kv_heads, head_dim), generator=g).bfloat16().to(device)
        slots = torch.randperm(num_tokens * 2, generator=g)[:num_tokens].to(device)
        shape = (num_tokens * 2 // 16, 16, kv_heads, head_dim)
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        outs = []
        for k in (ref, tri):
            caches = [torch.zeros(shape, device=device).to(dtype) for _ in range(2)]
            scales = [torch.zeros(shape[:3], device=device) for _ in range(2)] if fp8 else [None, None]
            k.store_kv(key, key, caches[0], caches[1], slots, scales[0], scales[1])
            outs.append((caches, scales, timed(lambda: k.store_kv(key, key, caches[0], caches[1], slots, *scales), device)))
        diff = (outs[0][0][0].float() - outs[1][0][0].float()).abs().max().item()
        label = f"{num_tokens} tokens kv={kv_heads} d={head_dim}" + (" fp8" if fp8 else " bf16")
        rows.append(("store_kv", label, outs[0][2], outs[1][2], diff))
    return rows


def bench_accept(ref, tri, device):
    S, nodes, vocab = (4, 6, 500) if device != "cuda" else (64, 16, 262144)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, vocab, (S, nodes), generator=g)
    parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, nodes)]).expand(S, nodes).contiguous()
    num_nodes = torch.full((S,), nodes)
    target = torch.softmax(torch.randn((S, nodes, vocab), generator=g) * 3, -1)
    target.scatter_add_(2, tokens.roll(-1, 1)[..., None], torch.full((S, nodes, 1), 2.0))
    target = target / target.sum(-1, keepdim=True)
    draft = torch.softmax(torch.randn((S, nodes, vocab), generator=g) * 3, -1)
    uniforms = torch.rand((S, nodes + 1), generator=g)
    argmax = target.argmax(-1)
    to = [t.to(device) for t in (tokens, parents, num_nodes, target, draft, uniforms, argmax)]
    tokens, parents, num_nodes, target, draft, uniforms, argmax = to
    rows = []
    for name, fn_args in [("accept_tree_greedy", (tokens, parents, num_nodes, argmax)),
                          ("accept_tree_sampling", (tokens, parents, num_nodes, target, draft, uniforms))]:
        r, t = getattr(ref, name), getattr(tri, name)
        same = all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(r(*fn_args), t(*fn_args)))
        rows.append((name, f"S={S} nodes={nodes} vocab={vocab}", timed(lambda: r(*fn_args), device),
                     timed(lambda: t(*fn_args), device), 0.0 if same else float("nan")))
    return rows


def print_table(rows) -> None:
    head = f"{'kernel':<22}{'shape':<48}{'reference ms':>14}{'triton ms':>12}{'speedup':>9}{'max |diff|':>12}"
    print(head)
    print("-" * len(head))
    for kernel, shape, ref_ms, tri_ms, diff in rows:
        print(f"{kernel:<22}{shape:<48}{ref_ms:>14.3f}{tri_ms:>12.3f}{ref_ms / tri_ms:>8.1f}x{diff:>12.2e}")


if __name__ == "__main__":
    sys.exit(main())
