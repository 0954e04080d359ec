"""verl's own agent-loop post-processing, timed on the samples ``collate.py`` hands over.

Run by ``benchmarks/collate.py`` with the Python of the verl venv (``.ci/integrations.sh``
builds it); it imports verl, torch, numpy and transformers only, never tokengym, so the
code timed here is the installed verl's and nothing of this project.

Input (``.npz``): every sample's prompt ids, response ids, response mask and logprobs,
flattened with their offsets, each sample's reward and number of turns, the widths P and
R, and the tokenizer's folder. Output (JSON on stdout): the timed runs, and for each
tensor of the last batch its shape, dtype and SHA-256 of its bytes, so that the caller
can prove the batch equal to ``to_verl``'s without shipping a gigabyte back.

What runs, per timed repeat, is what ``AgentLoopWorker.generate_sequences`` runs once the
agent loops have returned: ``_agent_loop_postprocess`` for every sample (``asyncio.gather``
in one event loop, as verl does), then ``_postprocess`` on all of them. The worker object
is made with ``object.__new__`` and given only the attributes those two methods read (a
text-only model: no processor, no reward-loop workers, no distillation), because its
``__init__`` starts the LLM server clients and loads tools that post-processing never uses.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import sys
import time
from typing import Any

import numpy as np
import torch
import transformers
from transformers import AutoTokenizer

try:
    import verl
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput, AgentLoopWorker
except ImportError as err:  # the integration venv installs only what verl's protocol imports
    sys.exit(
        f"verl's agent loop does not import in {sys.prefix}: {err}. "
        "It needs verl 0.9.1 (bash .ci/integrations.sh verl) and: "
        "pip install --no-deps hydra-core==1.3.8 antlr4-python3-runtime==4.9.3 && "
        "pip install pillow==13.0.0 datasets==5.2.0 pandas==3.1.1 cachetools==8.0.2 uvicorn==0.54.0 fastapi==0.165.0"
    )
from verl.workers.config import RolloutConfig  # noqa: E402

TENSORS = (
    "prompts",
    "responses",
    "response_mask",
    "input_ids",
    "attention_mask",
    "position_ids",
    "rollout_log_probs",
)


def make_worker(tokenizer: Any, prompt_length: int, response_length: int) -> AgentLoopWorker:
    """An AgentLoopWorker with just the state its post-processing reads."""
    worker = object.__new__(AgentLoopWorker)
    worker.tokenizer = tokenizer
    worker.processor = None
    worker.rollout_config = RolloutConfig(prompt_length=prompt_length, response_length=response_length)
    worker.mm_processor_kwargs = {}
    worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False
    return worker


def agent_loop_outputs(data: Any) -> list[AgentLoopOutput]:
    """What verl's agent loops return: one AgentLoopOutput of Python lists per sample (not timed)."""
    def split(name: str) -> list[list[Any]]:
        flat, off = data[name], data[name + "_offsets"].tolist()
        return [flat[a:b].tolist() for a, b in zip(off[:-1], off[1:])]

    fields = ("prompt_ids", "response_ids", "response_mask", "logprobs")
    prompts, responses, masks, logprobs = (split(k) for k in fields)
    return [
        AgentLoopOutput(
            prompt_ids=p,
            response_ids=r,
            response_mask=m,
            response_logprobs=lp,
            reward_score=float(score),
            num_turns=int(turns),
            metrics=AgentLoopMetrics(),
        )
        for p, r, m, lp, score, turns in zip(
            prompts, responses, masks, logprobs, data["reward"].tolist(), data["num_turns"].tolist()
        )
    ]


def postprocess(worker: AgentLoopWorker, outputs: list[AgentLoopOutput], loop: asyncio.AbstractEventLoop) -> Any:
    """verl's per-sample padding, then its batch concatenation."""

    async def each() -> list[Any]:
        return await asyncio.gather(
            *(worker._agent_loop_postprocess(o, False, raw_prompt=None) for o in outputs)
        )

    return worker._postprocess(loop.run_until_complete(each()))


def digest(t: torch.Tensor) -> dict[str, Any]:
    arr = t.contiguous().numpy()
    sha = hashlib.sha256(memoryview(arr).cast("B")).hexdigest()
    return {"shape": list(arr.shape), "dtype": str(arr.dtype), "sha256": sha}


def main(path: str, repeats: int) -> int:
    data = np.load(path)
    tokenizer = AutoTokenizer.from_pretrained(str(data["tokenizer"]))
    worker = make_worker(tokenizer, int(data["prompt_length"]), int(data["response_length"]))
    outputs = agent_loop_outputs(data)
    loop = asyncio.new_event_loop()
    batch = postprocess(worker, outputs, loop)  # warm-up, and the batch that is checked
    tensors = batch.batch
    rm = tensors["rm_scores"]
    result = {
        "verl": verl.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "pad_token_id": tokenizer.pad_token_id,
        "tensors": {k: digest(tensors[k]) for k in TENSORS},
        "rm_scores_row_sums": rm.sum(dim=1).tolist(),
        "rm_scores_nonzero_per_row": (rm != 0).sum(dim=1).tolist(),
        "runs_s": [],
        "cpu_runs_s": [],
    }
    del batch, tensors, rm
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        try:
            t0, c0 = time.perf_counter(), time.process_time()
            out = postprocess(worker, outputs, loop)
            result["runs_s"].append(time.perf_counter() - t0)
            result["cpu_runs_s"].append(time.process_time() - c0)
        finally:
            gc.enable()
        del out
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: collate_verl.py SAMPLES.npz REPEATS (run by benchmarks/collate.py)")
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
