"""What every SageMaker container contract (jobs/contract.py) must do, run for each registered one:
the training toolkit's and SDK v3 ModelTrainer's. In-process, pure values and a temporary folder."""

from __future__ import annotations

import json

import pytest

from disttrain.errors import UsageError
from disttrain.jobs.contract import CONTRACTS, ContainerContract, RunFacts, contract_for
from disttrain.jobs.distribution import NONE
from disttrain.jobs.layout import InstancePaths
from disttrain.jobs.sagemaker import Instance

HPS = {"epochs": 3, "lr": 0.5, "name": "abc", "use_bias": True, "ids": [1, 2]}
NAMES = ("algo-1", "algo-2")


def facts(tmp_path, *, command=None) -> RunFacts:
    return RunFacts(cwd=str(tmp_path / "code"), entry_point="train.py", command=command, distribution=NONE,
                    processes_per_instance=1, addresses=("10.0.0.1", "10.0.0.2"), master_port=29500,
                    names_resolve=True)


def instance(name: str) -> Instance:
    return Instance(job_name="job-1", name=name, names=NAMES, hyperparameters=HPS, channels=("train",),
                    entry_point="train.py")


@pytest.fixture(params=sorted(CONTRACTS))
def contract(request) -> ContainerContract:
    return contract_for(request.param)


def test_registered_by_its_name_and_typed(contract):
    assert isinstance(contract, ContainerContract)  # its members are all there
    assert CONTRACTS[contract.name] is contract
    assert contract.entry_name and isinstance(contract.runs_commands, bool)
    for member in ("encoded_hyperparameters", "worker_command", "instance_env", "write_files"):
        assert callable(getattr(contract, member))


def test_hyperparameters_are_text_and_every_key_kept(contract):
    encoded = contract.encoded_hyperparameters(HPS)
    assert list(encoded) == list(HPS) and all(isinstance(v, str) for v in encoded.values())
    assert json.loads(encoded["ids"]) == [1, 2]


def test_worker_command_passes_every_hyperparameter(contract, tmp_path):
    entry, is_module, args = contract.worker_command(facts(tmp_path), HPS)
    assert (entry, is_module) == ("train.py", False)
    assert all(isinstance(a, str) for a in args)
    named = {a.lstrip("-") for a in args if a.startswith("-")}
    assert named == set(HPS)


def test_commands_only_where_the_contract_runs_them(contract, tmp_path):
    entry, is_module, args = contract.worker_command(facts(tmp_path, command="echo hi"), {})
    assert (is_module and "echo hi" in args) == contract.runs_commands


def test_instance_env_is_the_instance_and_text(contract, tmp_path):
    for name in NAMES:
        paths = InstancePaths(tmp_path / name)
        env = contract.instance_env(instance(name), paths, facts(tmp_path))
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        assert env["SM_CURRENT_HOST"] == name
        assert json.loads(env["SM_HOSTS"]) == list(NAMES)
        assert env["SM_MODEL_DIR"] == str(paths.model)
        assert env["SM_CHANNEL_TRAIN"] == str(paths.channel("train"))
        assert json.loads(env["SM_HPS"]) == HPS


def test_write_files_reads_back_as_the_hyperparameters(contract, tmp_path):
    from disttrain.jobs.sagemaker import decoded_hyperparameters
    from disttrain.jobs.sagemaker_v3 import safe_deserialize

    paths = InstancePaths(tmp_path / "algo-1")
    paths.create()
    contract.write_files(instance("algo-1"), paths, facts(tmp_path))
    written = json.loads((paths.config / "hyperparameters.json").read_text())
    read = {k: safe_deserialize(v) for k, v in written.items()} if contract.runs_commands else \
        decoded_hyperparameters(written)
    assert {k: read[k] for k in HPS} == HPS
    assert json.loads((paths.config / "resourceconfig.json").read_text())["current_host"] == "algo-1"
    assert "train" in json.loads((paths.config / "inputdataconfig.json").read_text())


def test_an_unknown_contract_is_one_line():
    with pytest.raises(UsageError, match="contract must be one of toolkit, model_trainer, got 'v4'"):
        contract_for("v4")
