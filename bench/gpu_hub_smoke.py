"""A pod's path from the Hugging Face Hub on a real GPU: kernels pushed next to a model's weights, ``ensure`` at the
pod's start, the first call a hit.

Workload a of ``gpu_first_call.py`` (a matmul autotuned over 32 configs) compiles cold as root and is packed. The
archive goes to a private repository of the tests' Hub (``tests/servers.py``, on 127.0.0.1: the GPU machine reaches
no other network), as ``kernels/h200.tpack`` on ``main``. The service user (uid 1000) then runs ``ensure
hf://team/model/kernels/h200.tpack`` with its token into an empty volume of its own, as an init container would,
twice (the second must write nothing), and the workload, whose first call must be a cache hit: no file created or
modified under the volume. Records what the Hub and its CDN were asked.

Usage (GPU machine, as root): [TP_HUB_SITE=DIR] python bench/gpu_hub_smoke.py --out F
  TP_HUB_SITE: where huggingface_hub and aiohttp are, put on ensure's path alone (not the workload's)
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
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from gpu_fleet_smoke import SERVICE_UID, as_user, first_call  # noqa: E402
from servers import hugging_face_hub  # noqa: E402

URL = "hf://team/model/kernels/h200.tpack"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(HERE, "results", "gpu_hub_smoke.json"))
    args = parser.parse_args()
    import torch
    import triton

    work = tempfile.mkdtemp(prefix="tp-hub-")
    os.chmod(work, 0o755)
    os.umask(0o022)
    home, volume = os.path.join(work, "home"), os.path.join(work, "volume")
    for path in (home, volume):
        os.makedirs(path)
        os.chown(path, SERVICE_UID, SERVICE_UID)
    build, archive = os.path.join(work, "build", "cache"), os.path.join(work, "h200.tpack")
    doc: dict = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__}
    try:
        doc["cold_as_root"] = first_call(None, build, home)
        subprocess.run([sys.executable, "-m", "tritonpack", "pack", build, "-o", archive, "-q"], check=True)
        doc["archive_bytes"] = os.path.getsize(archive)
        with hugging_face_hub() as hub:
            with open(archive, "rb") as f:
                hub.commit("team/model", {"kernels/h200.tpack": f.read(), "config.json": b"{}"})
            hub.private.add("team/model")
            env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.token, "HF_HOME": home}
            if os.environ.get("TP_HUB_SITE"):  # huggingface_hub and aiohttp, kept out of the workload's path
                env["PYTHONPATH"] = os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"),
                                                                  os.environ["TP_HUB_SITE"])))
            for n in (1, 2):
                hub.asked.clear()
                ensured = subprocess.run([*as_user(SERVICE_UID, home), sys.executable, "-m", "tritonpack", "ensure",
                                          URL, "--cache-dir", volume, "--json"], env=env, capture_output=True,
                                         text=True)
                doc[f"ensure_{n}_as_service_user"] = {
                    "exit": ensured.returncode, "result": json.loads(ensured.stdout) if ensured.stdout else None,
                    "stderr": ensured.stderr.strip().splitlines(),
                    "hub_requests": len(hub.by("hub")), "cdn_requests": len(hub.by("cdn")),
                    "token_to_cdn": any(a[4] for a in hub.by("cdn"))}
        doc["first_call_as_service_user"] = first_call(SERVICE_UID, volume, home)
        doc["warm_as_root"] = first_call(None, build, home)
        for key, row in doc.items():
            if isinstance(row, dict) and "first_call_ms" in row:
                print(f"{key:<28} first {row['first_call_ms']:9.1f} ms  created {row['files_created']}  "
                      f"modified {row['files_modified']}  correct {row['correct']}", flush=True)
            else:
                print(f"{key:<28} {json.dumps(row)[:400]}", flush=True)
    finally:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
