"""SGLang's own benchmark client through pd-router: `python -m sglang.bench_serving --backend sglang` against the
router in front of the real fleet completes every request (random token ids: no dataset download)."""

import json
import os
import signal
import subprocess

from server_patches import launch_server
from harness.processes import kill_when_parent_dies, record_process_group

NUM_PROMPTS = 20
BENCH_TIMEOUT_S = 300


def test_bench_serving_through_the_router_completes_every_request(router, fleet, stack_paths, tmp_path):
    out = tmp_path / "bench.jsonl"
    cmd = [str(stack_paths.python), "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", router.url,
           "--dataset-name", "random-ids", "--tokenizer", str(stack_paths.tiny_model),
           "--num-prompts", str(NUM_PROMPTS), "--random-input-len", "64", "--random-output-len", "16",
           "--max-concurrency", "4", "--seed", "1", "--output-file", str(out), "--disable-tqdm"]
    # The stack's interpreter with the CPU patches on (SGLang imports torchvision's CUDA ops at import time).
    env = launch_server.server_environment(stack_paths, ["--device", "cpu"])
    env["PDR_SERVER_PATCHES_VERBOSE"] = "0"
    process = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               preexec_fn=kill_when_parent_dies)
    record_process_group(process.pid)
    try:
        output, _ = process.communicate(timeout=BENCH_TIMEOUT_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, output[-3000:]
    (result,) = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    assert result["completed"] == NUM_PROMPTS, output[-3000:]
    assert result["total_output_tokens"] > 0 and result["mean_ttft_ms"] > 0
    assert all(w["inflight"] == 0 for w in router.workers())
