"""Building a model without memory or initial values (``pagedllm.model.empty_init``): parameters on
the meta device, tied weights still tied, buffers real, the patched initialisers restored, and no
``torch._dynamo`` import on the way (it cost over a second of every start-up)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from helpers.server import REPO_ROOT
from pagedllm.model.empty_init import empty_modules, to_empty


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(8)
        self.register_buffer("table", torch.arange(6, dtype=torch.float32))


def test_parameters_are_meta_tied_and_buffers_real() -> None:
    with empty_modules():
        model = Tied()
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.head.weight is model.embed.weight
    assert model.table.device.type == "cpu" and model.table.tolist() == [0, 1, 2, 3, 4, 5]
    model = to_empty(model, "cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model.embed.weight.shape == (50, 8) and model.norm.weight.dtype == torch.float32


def test_initialisers_and_registration_are_restored_even_after_an_error() -> None:
    normal, register = nn.init.normal_, nn.Module.register_parameter
    with pytest.raises(RuntimeError, match="boom"), empty_modules():
        raise RuntimeError("boom")
    assert nn.init.normal_ is normal and nn.Module.register_parameter is register
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)  # initialised again, on the CPU
    assert layer.weight.device.type == "cpu" and layer.weight.abs().sum() > 0


def _modules_after(code: str) -> set[str]:
    script = f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    return set(out.stdout.split())


def test_building_the_default_model_does_not_import_dynamo() -> None:
    loaded = _modules_after(
        "from pagedllm.config import EngineConfig\n"
        "from pagedllm.engine.llm_engine import LLMEngine\n"
        "LLMEngine.from_config(EngineConfig(max_model_len=256, num_kv_blocks=16)).shutdown()"
    )
    assert "pagedllm.worker.model_runner" in loaded and "torch._dynamo" not in loaded


def test_serve_starts_its_cores_before_importing_torch() -> None:
    """``pagedllm serve`` parses its arguments and starts the engine cores with neither torch nor
    transformers imported: the cores load the model while the front-end imports them."""
    loaded = _modules_after(
        "import argparse\n"
        "from pagedllm.entrypoints.openai import launcher\n"
        "parser = argparse.ArgumentParser()\n"
        "launcher.add_cli_args(parser)\n"
        "args = parser.parse_args(['--max-model-len', '1024'])\n"
        "assert launcher.check_args(args) is None\n"
        "assert launcher.engine_config_from_args(args) is not None"
    )
    assert "pagedllm.engine.proc.launch" in loaded
    assert not {"torch", "transformers"} & loaded
