"""A container image's path on a real GPU: built as root, served as another user.

Workload a of ``gpu_first_call.py`` (a matmul autotuned over 32 configs, ``cache_results=True``) compiles cold as
root; its cache is packed to standard output and unpacked from standard input into the image's root (``pack -o - |
unpack -``, umask 022). The service user (uid 1000, no write access to that root) then runs ``ensure`` on an
archive of it, which must write nothing, and the workload, whose first call must be a cache hit: no file created
or modified under the root, and its time near a warm run's. Root's run of the same root is the reference.

Usage (GPU machine, as root): python bench/gpu_fleet_smoke.py --out bench/results/gpu_fleet_smoke.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gpu_first_call  # noqa: E402

SERVICE_UID = 1000


def as_user(uid: int | None, home: str) -> list[str]:
    """The command prefix that runs as ``uid`` (none: root, as the image's build does)."""
    if uid is None:
        return []
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "env", f"HOME={home}"]


def run(prefix: list[str], args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, *args], env=env, capture_output=True, text=True)


def ensure_as(uid: int, home: str, archive: str, env: dict[str, str], *args: str) -> dict:
    """``tritonpack ensure ARCHIVE ARGS --json`` as ``uid``: its exit status, its result and what it said."""
    ensured = run(as_user(uid, home), [sys.executable, "-m", "tritonpack", "ensure", archive, *args, "--json"], env)
    return {"exit": ensured.returncode, "result": json.loads(ensured.stdout) if ensured.stdout else None,
            "stderr": ensured.stderr.strip().splitlines()}


def first_call(uid: int | None, root: str, home: str) -> dict:
    """Workload a's first call in a process of its own (its script copied where every user may read it)."""
    env = {**os.environ, "TRITON_CACHE_DIR": root, "PYTHONUNBUFFERED": "1", "HOME": home}
    before = gpu_first_call.snapshot(root)
    script = os.path.join(home, "gpu_first_call.py")
    if not os.path.exists(script):
        shutil.copy(gpu_first_call.__file__, script)
    proc = run(as_user(uid, home), [sys.executable, script, "--worker", "a"], env)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]}
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    after = gpu_first_call.snapshot(root)
    row["files_created"] = len(set(after) - set(before))
    row["files_modified"] = sum(1 for k in set(after) & set(before) if after[k] != before[k])
    return row


def workspace(prefix: str) -> tuple[str, str]:
    """A work directory every user may enter, files made with umask 022 (as an image's build makes them), and the
    service user's home in it; the GPU, Triton and torch of the run, the first rows of its report."""
    work = tempfile.mkdtemp(prefix=prefix)
    os.chmod(work, 0o755)
    os.umask(0o022)
    home = os.path.join(work, "home")
    os.makedirs(home)
    os.chown(home, SERVICE_UID, SERVICE_UID)
    return work, home


def machine() -> dict:
    import torch
    import triton

    return {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__}


def report(doc: dict, out: str) -> None:
    """Each row of ``doc`` on a line (a first call's figures, else its JSON), and ``doc`` written to ``out``."""
    for key, row in doc.items():
        if isinstance(row, dict) and "first_call_ms" in row:
            print(f"{key:<28} first {row['first_call_ms']:9.1f} ms  created {row['files_created']}  "
                  f"modified {row['files_modified']}  correct {row['correct']}", flush=True)
        else:
            print(f"{key:<28} {json.dumps(row)[:400]}", flush=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(HERE, "results", "gpu_fleet_smoke.json"))
    args = parser.parse_args()
    work, home = workspace("tp-fleet-")
    build, image = os.path.join(work, "build", "cache"), os.path.join(work, "image", "cache")
    archive = os.path.join(work, "kernels.tpack")
    tool = f"{sys.executable} -m tritonpack"
    doc = machine()
    try:
        doc["cold_as_root"] = first_call(None, build, home)
        piped = subprocess.run(["bash", "-o", "pipefail", "-c",
                                f"{tool} pack {build} -o - | {tool} unpack - --cache-dir {image}"],
                               capture_output=True, text=True)
        doc["pack_to_unpack_pipe"] = {"exit": piped.returncode, "stderr": piped.stderr.strip().splitlines()}
        subprocess.run([sys.executable, "-m", "tritonpack", "pack", build, "-o", archive, "-q"], check=True)
        env = {**os.environ, "TRITON_CACHE_DIR": image}
        doc["ensure_as_service_user"] = ensure_as(SERVICE_UID, home, archive, env)
        doc["first_call_as_service_user"] = first_call(SERVICE_UID, image, home)
        doc["first_call_as_root"] = first_call(None, image, home)
        doc["warm_as_root"] = first_call(None, build, home)
    finally:
        report(doc, args.out)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
