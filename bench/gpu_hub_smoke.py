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
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from gpu_fleet_smoke import SERVICE_UID, ensure_as, first_call, machine, report, workspace  # noqa: E402
from servers import hugging_face_hub  # noqa: E402

URL = "hf://team/model/kernels/h200.tpack"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(HERE, "results", "gpu_hub_smoke.json"))
    args = parser.parse_args()
    work, home = workspace("tp-hub-")
    volume = os.path.join(work, "volume")  # the pod's, its user's own
    os.makedirs(volume)
    os.chown(volume, SERVICE_UID, SERVICE_UID)
    build, archive = os.path.join(work, "build", "cache"), os.path.join(work, "h200.tpack")
    doc = machine()
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
                doc[f"ensure_{n}_as_service_user"] = {
                    **ensure_as(SERVICE_UID, home, URL, env, "--cache-dir", volume),
                    "hub_requests": len(hub.by("hub")), "cdn_requests": len(hub.by("cdn")),
                    "token_to_cdn": any(a[4] for a in hub.by("cdn"))}
        doc["first_call_as_service_user"] = first_call(SERVICE_UID, volume, home)
        doc["warm_as_root"] = first_call(None, build, home)
    finally:
        report(doc, args.out)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
