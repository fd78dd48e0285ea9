"""What moving the target's features to an EAGLE-3 speculator costs per SSD round, on the process link.

Each round's request carries the verified positions' features: k+1 rows of A*H_t values per sequence (K+1 when
every draft is accepted). The process link packs them into one frame of the target's dtype and sends it over
Gloo; the thread link hands the tensor over (no copy, no bytes). This times the process link's whole request
path -- ``pack_request``, ``Channel.send``, the speculator's ``recv`` and ``unpack_request`` -- against the same
request without features, with a one-word reply, the two processes on their own cores (the engine's pinning).
Shapes default to Qwen2.5-Coder-1.5B (H_t 1536, 3 taps, bf16), K=3.

    python -m benchmarks.eagle_transport                     # batch 1, 4, 16 and 64
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import environment, log, table, write_results
from saguaro.cores import pin_process
from saguaro.ssd.channel import Channel, MessageCounters
from saguaro.workers.process import free_port
from saguaro.workers.process import WorkerProcess
from saguaro.ssd.protocol import CMD_STOP, Outcome, RoundRequest, pack_request, unpack_request


def _speculator_side(port: int, counters: MessageCounters, core: int) -> None:
    """The child: unpack every request (as the speculator does) and answer with one word."""
    pin_process([core], 1)
    channel = Channel(1, port, counters, "gloo", "cpu", 120)
    while (req := unpack_request(channel.recv(timeout_s=120))).command != CMD_STOP:
        channel.send(torch.tensor([len(req.outcomes)], dtype=torch.int64))


def request(batch: int, k: int, width: int, dtype: torch.dtype, features: bool) -> RoundRequest:
    rows = torch.randn(batch, k + 1, width).to(dtype)  # every draft accepted: K+1 verified positions
    return RoundRequest([Outcome(i, k, 7, rows[i] if features else None) for i in range(batch)],
                        order=list(range(batch)))


def measure(batches: list[int], k: int, width: int, dtype: torch.dtype, rounds: int) -> list[dict[str, Any]]:
    from benchmarks import eagle_transport  # by its module name, never __main__: the child imports it
    port, counters = free_port(), MessageCounters()
    child = WorkerProcess(eagle_transport._speculator_side, (port, counters, 1), [counters.file],
                          role="transport echo", hint="fix the error above")
    pin_process([0], 1)
    try:
        channel = child.expect("connecting", lambda: Channel(0, port, counters, "gloo", "cpu", 120), 120)
        out = []
        for batch in batches:
            reqs = {f: request(batch, k, width, dtype, f) for f in (False, True)}
            samples: dict[bool, list[float]] = {False: [], True: []}
            for i in range(2 * (rounds + 5)):  # alternating, so that load changes hit both alike
                with_features = bool(i % 2)
                start = time.perf_counter()
                channel.send(pack_request(reqs[with_features]))
                channel.recv(timeout_s=120)
                if i >= 10:  # warm-up rounds dropped
                    samples[with_features].append(time.perf_counter() - start)
            times = {f: statistics.median(v) * 1e3 for f, v in samples.items()}
            frame = pack_request(request(batch, k, width, dtype, True))[1]
            out.append({"batch": batch, "feature_bytes": frame.numel() * frame.element_size(),
                        "round_ms_without": times[False], "round_ms_with": times[True],
                        "features_ms": times[True] - times[False]})
            log(f"batch {batch}: {out[-1]}")
        channel.send(pack_request(RoundRequest(command=CMD_STOP)))
        child.join(10)
    finally:
        child.kill()
    return out


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    from benchmarks.bench_eagle import cpu_name
    dtype = str(args.dtype).replace("torch.", "")
    lines = ["# Moving the target's features to an EAGLE-3 speculator (SSD, process link)", "",
             f"CPU: {cpu_name()}, load average {environment()['loadavg']}. Target features of width {args.width} "
             f"({dtype}), K={args.k}, every draft accepted (K+1 rows per sequence and round); median of "
             f"{args.rounds} rounds of each, alternating. round ms: the request's pack, Gloo send, receive and "
             "unpack, plus a one-word reply, without and with the features; features ms: the difference. The thread "
             "link passes the same tensors by reference: no bytes, no copy.", "",
             table(["batch", "feature bytes / round", "round ms without", "round ms with", "features ms"],
                   [[r["batch"], f"{r['feature_bytes']:,}", f"{r['round_ms_without']:.3f}",
                     f"{r['round_ms_with']:.3f}", f"{r['features_ms']:.3f}"] for r in rows])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.eagle_transport", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--width", type=int, default=3 * 1536, help="A*H_t (default: 3 taps of the 1.5B)")
    p.add_argument("--dtype", type=lambda s: getattr(torch, s), default=torch.bfloat16)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--out", type=Path, default=Path("results"))
    args = p.parse_args(argv)
    rows = measure(args.batches, args.k, args.width, args.dtype, args.rounds)
    markdown = report(rows, args)
    print(markdown)
    payload = {"benchmark": "eagle_transport", "settings": {"k": args.k, "width": args.width,
                                                           "dtype": str(args.dtype), "rounds": args.rounds},
               "environment": environment(), "rows": rows}
    write_results(args.out, "bench_eagle_transport", payload, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
