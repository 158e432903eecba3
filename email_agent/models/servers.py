"""Evaluation's servers: each trained run served by the backend it was trained on, for one evaluation.

Owns `Servers`, which an evaluation (or `ask`, `serve`) holds for as long as its models play: one vLLM server per
base model on this machine's CPU, which every CPU model plays on (a checkpoint is a LoRA loaded into it), and
one ART model registered per run trained on an ART backend (several steps of one run share that backend, where
each would otherwise start its own trainer and vLLM on the same GPU). What cannot be served here is said with the
way around it (`cannot_serve`). It plays nothing: `opened` makes opened models of what it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import httpx

from email_agent import backends
from email_agent.backends.vllm_server import VLLMServer
from email_agent.errors import UserError
from email_agent.redact import redact
from email_agent.runs import Run, is_step


class Servers:
    """The servers of one evaluation, closed with `stack`. `options` is the evaluation's `opened.Options`: where
    runs and logs live, the timeout, the decoding batch, the seed and the largest LoRA the CPU server holds."""

    def __init__(self, options, stack: contextlib.AsyncExitStack) -> None:
        self.options = options
        self._stack = stack
        self._cpu: dict[str, asyncio.Future[VLLMServer]] = {}  # base model -> its server, started once
        self._art: dict[Path, object] = {}  # run folder -> its art.TrainableModel, registered once

    async def on_cpu(self, base_model: str, checkpoint: Path | None, label: str | None, lora_rank: int = 8):
        """(client, model name) on the vLLM server of `base_model`: the base model under the server's name for it,
        a checkpoint a LoRA loaded into it as `label`. The first call starts the server."""
        # here, not at the top: openai takes ~0.4 s (pydantic) and backends.cpu imports torch, transformers, peft, ART
        from openai import AsyncOpenAI

        from email_agent.backends.cpu import CheckpointError
        from email_agent.backends.cpu.checkpoints import check_adapter

        if base_model not in self._cpu:
            self._cpu[base_model] = asyncio.ensure_future(self._start_cpu_server(base_model, lora_rank))
        server = await self._cpu[base_model]
        if checkpoint is not None:
            try:
                check_adapter(str(checkpoint))
            except CheckpointError as exc:
                raise UserError(str(exc)) from None
            await server.load_lora(label, str(checkpoint))
        client = AsyncOpenAI(base_url=server.base_url, api_key="local", timeout=self.options.timeout, max_retries=2)
        return client, label if checkpoint is not None else server.served_name

    async def _start_cpu_server(self, base_model: str, lora_rank: int) -> VLLMServer:
        # here, not at the top: backends.cpu imports torch, transformers, peft and ART (seconds)
        from email_agent.backends.cpu.model import load_tokenizer, served_model_dir

        options = self.options
        tokenizer = await asyncio.to_thread(load_tokenizer, base_model)  # its tool chat template
        log = Path(options.log_dir or Path(options.art_dir) / "logs") / "vllm-evaluation.log"
        server = VLLMServer(served_model_dir(base_model), backends.cpu_served_name(base_model),
                            chat_template=tokenizer.chat_template, log_path=log,
                            lora_rank=max(lora_rank, options.cpu_lora_rank),
                            max_num_seqs=max(32, options.concurrency * 3), seed=options.seed)
        self._stack.push_async_callback(server.close)
        server.start()
        await server.wait_ready()
        return server

    async def with_art(self, run: Run, step: str):
        """A run trained on an ART backend, served by that backend: a model of the same name, project and folder
        registered (as training does), then the step asked for. Returns (client, label, served model name).
        A second step of the same run is served by the backend the first one started."""
        # here, not at the top: openai takes ~0.4 s (pydantic), and --help loads this module
        from openai import AsyncOpenAI

        try:
            model = self._art.get(run.path)
            if model is None:
                model = await self._register(run, step)
            latest = await model.get_step()
            wanted = latest if step in ("", "latest") else int(step)
            if backends.get(run.backend).serves_latest_only and wanted != latest:
                # ART 0.5.18 serves only the latest step and has no public call for another: load that LoRA
                # into the running vLLM the way ART itself does after each training step.
                _, folder = run.checkpoint(str(wanted))
                await load_lora_adapter(model.inference_base_url, model.inference_api_key,
                                        model.get_inference_name(wanted), str(folder.resolve()))
            served = model.get_inference_name(wanted)
            # Our own client on the model's endpoint and key, as training's Policy.for_model does: ART 0.5.18's
            # model.openai_client() hands openai an httpx.Timeout it cannot add to a float (TypeError per request).
            client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key or "none",
                                 timeout=self.options.timeout, max_retries=2)
        except UserError:
            raise
        except Exception as exc:  # a runtime that will not build or start: say so, with the way around it
            raise UserError(cannot_serve(run, step, f"{type(exc).__name__}: {redact(str(exc)[:300])}")) from None
        return client, f"{run.name}@{wanted}", served

    async def _register(self, run: Run, step: str):
        """The run's model registered on a backend of the kind it was trained on, with the settings it saved."""
        # here, not at the top: ART imports torch and transformers (seconds), and --help loads this module
        import art

        settings = backends.BackendSettings.of(run.config, art_dir=run.art_dir)
        backends.hide_wandb_key(run.backend, wandb=False)  # ART would start a W&B run to serve it
        try:
            backend = backends.get(run.backend).make(settings)
        except backends.BackendError as exc:
            raise UserError(cannot_serve(run, step, str(exc))) from None
        self._stack.push_async_callback(backend.close)
        model = art.TrainableModel(
            name=run.name, project=run.project, base_model=run.base_model, base_path=run.art_dir,
            _internal_config=backends.get(run.backend).model_config(settings))
        await model.register(backend)
        self._art[run.path] = model
        return model


async def load_lora_adapter(base_url: str, api_key: str | None, lora_name: str, path: str) -> None:
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/load_lora_adapter"
    async with httpx.AsyncClient(timeout=120.0) as client:
        response = await client.post(url, json={"lora_name": lora_name, "lora_path": path, "load_inplace": True},
                                     headers={"Authorization": f"Bearer {api_key or 'none'}"})
    if response.status_code >= 400:
        raise UserError(f"vLLM would not load the LoRA {path} as {lora_name} (HTTP {response.status_code}: "
                        f"{response.text[:200]}).")


def cannot_serve(run: Run, step: str, reason: str) -> str:
    """What is missing to serve a run the way it was trained, and the way around it."""
    message = f"run {run.name!r} was trained on the {run.backend} backend, which cannot serve it here: {reason}"
    steps = run.steps()
    if not steps:
        return message + (f" Its checkpoints are not in {run.path / 'checkpoints'}; evaluate it where it was "
                          f"trained, or copy its folder there first.")
    number = steps[-1] if step in ("", "latest") or not is_step(step) else int(step)
    folder = run.path / "checkpoints" / f"{number:04d}"
    rank = backends.readiness.vllm_lora_rank(run.config.get("lora_rank", 8))
    return message + (f" To evaluate it anyway, serve the checkpoint with vLLM on a GPU machine: `vllm serve "
                      f"{run.base_model} --enable-lora --max-lora-rank {rank} --lora-modules {run.name}={folder} "
                      f"--enable-auto-tool-choice --tool-call-parser hermes`, then pass --model "
                      f"hosted_vllm/{run.name} --base-url http://HOST:8000/v1 (see docs/evaluation.md, 'A GPU "
                      f"run, evaluated anywhere').")
