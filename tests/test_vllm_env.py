"""The environment vLLM is started with: our rank's torch.distributed variables do not reach it.

The smoke stage runs in a rank that the elastic agent started (launcher.executors.local_agent), so
its environment has RANK, MASTER_PORT, ... and TORCHELASTIC_USE_AGENT_STORE=True.  With that last
one, every ``init_process_group(init_method="tcp://...")`` of a child process is a TCPStore client
of that address: vLLM's engine, which hosts its own store, then waits for a server that never comes
(the H200 smoke hung at vLLM's process-group init until the startup timeout).  The test runs that
init for real (gloo, world size 1) in a child process, with our rank's environment and with
``vllm_env``'s."""
import os
import socket
import subprocess
import sys

import pytest

from launcher.vllm.probe import vllm_env

RANK_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
            "ROLE_RANK": "0", "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "stage-29999",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}

# what vLLM's engine does at start (world size 1): host a store at its own address, join the group
INIT = """
import datetime, sys, torch.distributed as dist
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=8))
print("joined", dist.get_world_size())
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank_variables_are_dropped_and_user_values_kept():
    env = vllm_env({**RANK_ENV, "CUDA_VISIBLE_DEVICES": "0", "VLLM_HOST_IP": "10.0.0.5", "PYTHONPATH": "/x"},
                   device="cuda")
    assert not [k for k in env if k in RANK_ENV]
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["VLLM_HOST_IP"] == "10.0.0.5" and "PYTHONPATH" not in env


@pytest.mark.torch
def test_a_child_started_with_our_rank_env_cannot_host_its_process_group_and_with_vllm_env_it_can():
    base = {**os.environ, **RANK_ENV}
    hung = subprocess.run([sys.executable, "-c", INIT, str(_port())], env=base, capture_output=True, text=True,
                          timeout=120)
    assert hung.returncode != 0 and "joined" not in hung.stdout      # a store client with no server: timed out
    ok = subprocess.run([sys.executable, "-c", INIT, str(_port())],
                        env={**vllm_env(base, device="cuda"), "PYTHONPATH": os.pathsep.join(sys.path)},
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.strip() == "joined 1"
