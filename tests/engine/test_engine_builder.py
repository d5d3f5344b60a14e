"""Engine construction apart from the loop: every executor implements the ``ModelExecutor`` protocol
(the engine tests no executor type), the builder's parts run an engine, and generation and
embeddings are task strategies (the engine's loop methods test no task)."""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine.engine_builder import build_engine_parts
from pagedllm.engine.engine_tasks import GenerateTask, PoolingTask
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.pooling_processor import PoolingLimits, PoolingProcessor
from pagedllm.model.pooling import PoolingConfig
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.draft_model import DraftExecutor
from pagedllm.worker.encoder_executor import EncoderExecutor
from pagedllm.worker.executor import Executor
from pagedllm.worker.executor_protocol import ModelExecutor
from pagedllm.worker.parallel_executor import ParallelExecutor

ENGINE_SOURCE = Path(inspect.getfile(LLMEngine)).read_text()


def _protocol_members() -> set[str]:
    return {
        name
        for name, value in vars(ModelExecutor).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }


@pytest.mark.parametrize("cls", [Executor, ParallelExecutor, DraftExecutor, EncoderExecutor])
def test_every_executor_has_every_protocol_member(cls: type) -> None:
    """A member is a class attribute (method, property, constant) or set on ``self`` when built."""
    assert len(_protocol_members()) >= 20
    built = "\n".join(
        inspect.getsource(c.__init__) for c in cls.__mro__ if c is not object and "__init__" in vars(c)
    )
    missing = [
        name
        for name in _protocol_members()
        if not hasattr(cls, name) and not re.search(rf"self\.{name}\s*[:=]", built)
    ]
    assert not missing, f"{cls.__name__} lacks {missing}"


def test_the_engine_tests_no_executor_type_and_no_task() -> None:
    """The engine talks to the protocol and to its task strategy: no ``isinstance`` of an executor,
    no comparison of ``task`` anywhere in ``llm_engine.py``."""
    wrong = []
    for node in ast.walk(ast.parse(ENGINE_SOURCE)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            text = ast.unparse(node)
            if "executor" in text.lower():
                wrong.append(text)
        elif isinstance(node, ast.Compare):
            text = ast.unparse(node)
            if "task" in text and ("'embed'" in text or "'generate'" in text):
                wrong.append(text)
    assert not wrong, wrong


@pytest.fixture(scope="module")
def built() -> Any:
    config = EngineConfig(num_kv_blocks=64, max_model_len=512, async_scheduling=False)
    return config, build_engine_parts(config)


def test_an_engine_runs_on_the_parts_it_is_given(built: Any) -> None:
    config, parts = built
    with pytest.raises(ValueError, match="parts: built from another EngineConfig"):
        LLMEngine(replace(config), parts)
    engine = LLMEngine(config, parts)
    assert engine.scheduler is parts.scheduler and engine.executor is parts.executor
    assert isinstance(engine.task_strategy, GenerateTask) and engine.task == "generate"
    assert engine.max_in_flight == 1 and not engine.async_scheduling
    engine.add_request("a", "The capital of France is", SamplingParams(temperature=0, max_tokens=4))
    assert engine.get_num_unfinished_requests() == 1
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 4
    assert engine.get_num_unfinished_requests() == 0
    engine.check_idle()
    with pytest.raises(AttributeError, match="pooling_config"):
        engine.pooling_config  # noqa: B018 - a generating engine pools nothing
    with pytest.raises(ValueError, match="task 'generate': its steps are run by step()"):
        engine.step_pooling()


def test_a_pooling_task_refuses_generation(built: Any) -> None:
    _, parts = built
    pooling = PoolingProcessor(
        parts.input_processor, PoolingConfig("last", True, 576), PoolingLimits(512, 16, 64)
    )
    task = PoolingTask("m", False, parts.scheduler, pooling)
    with pytest.raises(ValueError, match="task 'embed': its steps are run by step_pooling()"):
        task.check_step()
    with pytest.raises(ValueError, match="start this model with task='generate'"):
        task.add_request("x", "Hello", SamplingParams(max_tokens=2), None, 0)
    assert task.num_unfinished() == 0 and not parts.scheduler.has_unfinished_requests()
    task.abort("unknown")  # nothing to abort
    task.check_idle()
