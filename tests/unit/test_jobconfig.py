"""``job.json``: its schema is a model (``resources.jobfile``), and every reader and writer of the file keeps to it.

The parser (``jobconfig.JobConfig.parse``) is hand-written so that the GPU host, which has no pydantic, can read the
file; these tests hold it, the operator's writer and the embedded default's writer to the model, field by field.
The generated schema and reference page are checked for drift with the CRDs (``test_crds``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from weightsync import jobconfig
from weightsync.errors import PermanentError
from weightsync.resources import jobfile
from weightsync.vocabulary import Channel, PauseMode, SyncMode

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
EVERY_FIELD = {
    "job": "j",
    "sync": {
        "everySteps": 3,
        "channels": ["nccl", "volume"],
        "ackPolicy": "Quorum",
        "quorum": 2,
        "readyWithoutAcks": True,
        "pauseMode": "abort",
        "mode": "staged",
        "allOrNothing": True,
        "timeoutSeconds": 700,
        "transferTimeoutSeconds": 90,
        "joinTimeoutSeconds": 7,
        "retention": 5,
    },
    "checkpointDir": "/ckpt",
    "ncclDomain": "fabric",
}


def test_the_parser_reads_every_field_the_model_declares() -> None:
    jobfile.JobFile.model_validate(EVERY_FIELD)  # a file the schema accepts
    config = jobconfig.JobConfig.parse(EVERY_FIELD)
    assert config == jobconfig.JobConfig(
        job="j",
        channels=(Channel.NCCL, Channel.VOLUME),
        ack_quorum=2,
        timeout_s=700.0,
        transfer_timeout_s=90.0,
        join_timeout_s=7.0,
        retention=5,
        checkpoint_dir="/ckpt",
        nccl_domain="fabric",
        every_steps=3,
        ready_without_acks=True,
        pause_mode=PauseMode.ABORT,
        sync_mode=SyncMode.STAGED,
        all_or_nothing=True,
    )
    sync_fields = set(jobfile.schema()["properties"]["sync"]["properties"])
    unread = sync_fields - set(EVERY_FIELD["sync"]) - {"rdma", "checkpointVolume"}  # what pods and the operator use
    assert not unread, f"sync fields the processes never read: {sorted(unread)}"


def test_the_parsers_defaults_are_the_models() -> None:
    assert jobconfig.JobConfig.parse({"job": "j"}) == jobconfig.JobConfig.parse(jobfile.JobFile(job="j").to_wire())


def test_the_embedded_defaults_file_is_one_the_schema_accepts() -> None:
    config = jobconfig.JobConfig.parse(EVERY_FIELD)
    assert jobconfig.JobConfig.parse(jobfile.JobFile.model_validate(config.to_json()).to_wire()) == config


def test_a_file_without_its_job_or_with_a_bad_value_names_it_and_the_reference() -> None:
    with pytest.raises(PermanentError, match=r"job.json: the job config has no 'job' .* docs/job-config.md"):
        jobconfig.JobConfig.parse({"sync": {}})
    with pytest.raises(PermanentError, match=r"malformed job config .*'often'.* docs/job-config.md"):
        jobconfig.JobConfig.parse({"job": "j", "sync": {"pauseMode": "often"}})


def test_the_reference_page_lists_every_field_with_its_default() -> None:
    page = (REPO / "docs" / "job-config.md").read_text()
    for field in ("`job`", "`sync.pauseMode`", "`sync.transferTimeoutSeconds`", "`checkpointDir`", "`ncclDomain`"):
        assert field in page
    schema = json.loads((REPO / "docs" / "job-config.schema.json").read_text())
    assert schema["required"] == ["job"] and schema["$id"] == jobfile.SCHEMA_ID
