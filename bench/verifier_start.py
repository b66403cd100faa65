"""How long a verifier takes to serve: from its process's start to its ready file, with an
empty prepared-weight cache (the first start: the W8A8 preparation runs) and then with the
entry that start wrote (every later start), and each one's peak memory (VmHWM).

    python -m pardec.bench.verifier_start [--model PATH] [--threads N] [--starts 3] [--embedding-dtype D]

Each start's memory is given twice: the peak (VmHWM) and what the process holds once ready to
serve (VmRSS, the model as served).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pardec.verifier.config import EMBEDDING_DTYPES


def start_once(model: str | None, cache: Path, threads: int, workdir: Path,
               extra: list[str]) -> tuple[float, float, float]:
    """Seconds to ready, peak RSS and RSS when ready, in MiB, of one verifier started and stopped."""
    ready = workdir / "verifier.addr"
    ready.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pardec.verifier", "--addr", "127.0.0.1:0", "--ready-file", str(ready),
               "--prepared-cache", str(cache), "--log-level", "WARNING"]
    command += ["--model", model] if model else []
    command += ["--threads", str(threads)] if threads else []
    command += extra
    begin = time.perf_counter()
    process = subprocess.Popen(command)
    try:
        while not ready.exists():
            if process.poll() is not None:
                raise RuntimeError(f"the verifier exited with code {process.returncode}")
            time.sleep(0.02)
        seconds = time.perf_counter() - begin
        status = Path(f"/proc/{process.pid}/status").read_text()
        peak, held = (int(re.search(rf"{field}:\s+(\d+) kB", status).group(1)) / 1024 for field in ("VmHWM", "VmRSS"))
    finally:
        process.terminate()
        process.wait(timeout=30)
    return seconds, peak, held


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pardec.bench.verifier_start", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF file or checkpoint directory (default: the bundled model)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--starts", type=int, default=3, help="starts from the cache after the first")
    parser.add_argument("--no-cost-curve", action="store_true",
                        help="skip the step cost curve (minutes for a 1B model on a few cores; it adds no memory)")
    parser.add_argument("--embedding-dtype", choices=EMBEDDING_DTYPES, default="auto", help="the verifier's flag")
    args = parser.parse_args(argv)
    extra = (["--no-cost-curve"] if args.no_cost_curve else []) + ["--embedding-dtype", args.embedding_dtype]
    with tempfile.TemporaryDirectory(prefix="verifier-start-") as tmp:
        cache, workdir = Path(tmp) / "cache", Path(tmp)
        rows = [("empty cache (prepares)", *start_once(args.model, cache, args.threads, workdir, extra))]
        rows += [(f"from the cache ({i + 1})", *start_once(args.model, cache, args.threads, workdir, extra))
                 for i in range(args.starts)]
    print("| start | seconds to ready | peak RSS MiB (VmHWM) | RSS when ready MiB (VmRSS) |\n|---|---:|---:|---:|")
    for name, seconds, peak, held in rows:
        print(f"| {name} | {seconds:.1f} | {peak:.0f} | {held:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
