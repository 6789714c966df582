"""vLLM's own tests of a secondary tier, as vLLM 0.33's source distribution publishes them,
run against the kvtier tier, and every one of their cases accounted for.

`tests/v1/kv_offload/tiering/test_fs_tier.py` tests vLLM's filesystem tier through the
`SecondaryTierManager` interface. Its module is loaded as published (extracted once by
tools/fetch_vllm_tests.py, which `make test` runs; never committed) with the one name its
tests build their tier from, `FileSystemTierManager`, bound to `KVTierInPlaceOfFs`: kvtier's
tier on a live agent, taking the fs tier's arguments (each `root_dir` a scope of its own).
The cases marked "run as published" run here unchanged. The others assert what only a
filesystem has (block files, O_DIRECT, its C extension and thread pool) or what kvtier does
differently on purpose; each says why, and names the contract test (test_tier_contract.py,
test_plugin.py) that holds kvtier to what of the case applies to a tier that is not a
filesystem. `test_tiering_offloading.py` tests vLLM's manager against vLLM's example tier
(whose internals its cases set), so none runs as published; the cases where what the
tier does matters are answered the same way.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvtier.api.config import parse_config
from kvtier.local.agent import AgentProcess
from kvtier.vllm.tier import KVTierSecondaryTier
from tests.conftest import AGENT_PYTHON, config_data

REPO = Path(__file__).resolve().parents[2]
PUBLISHED = Path(os.environ.get("KVTIER_VLLM_TESTS", REPO / ".venv-vllm" / "vllm-tests"))
TIERING = PUBLISHED / "tests" / "v1" / "kv_offload" / "tiering"
FS_ROW = 2 << 20  # the published fs tests' block: 128 pages of float32

RUN = "run as published"
FS_ONLY = "does not apply: "

FS_TIER_CASES = {
    "test_lookup_empty_tier": RUN,
    "test_store_creates_file_and_lookup_succeeds": FS_ONLY
    + "asserts the block file on disk; its store-then-HIT: "
    "passes: test_tier_contract::test_store_then_lookup_hits_and_a_load_leaves_the_chunk",
    "test_store_accepts_block_published_by_another_writer": FS_ONLY
    + "injects EEXIST into the fs tier's rename; the race it guards, two engines storing "
    "one key: passes: test_tier_contract::test_two_engines_store_the_same_keys_at_once",
    "test_store_then_load_roundtrip": FS_ONLY
    + "asserts the block files survive a load; that the chunks do: "
    "passes: test_tier_contract::test_store_then_lookup_hits_and_a_load_leaves_the_chunk",
    "test_invalid_path_raises_at_construction": FS_ONLY
    + "kvtier has no root directory, and starts without its agent on purpose (an agent "
    "that is not there serves misses: test_plugin::test_agent_killed_mid_job_then_restarted)",
    "test_invalid_locality_raises_at_construction": RUN,
    "test_factory_forwards_locality_to_fs_tier": FS_ONLY
    + "builds vLLM's fs tier by its type name; for kvtier's: "
    "passes: test_tier_contract::test_the_factory_forwards_locality",
    "test_failed_load_missing_file": RUN,
    "test_multiple_jobs_tracked_independently": RUN,
    "test_multi_block_job_partial_failure": RUN,
    "test_shutdown_discards_pending_tasks": FS_ONLY
    + "reads the fs thread pool's queues; kvtier finishes queued copies (drain never cuts "
    "one short) and a second shutdown does nothing: passes: "
    "test_tier_contract::test_shutdown_twice_then_the_manager_shuts_down_its_primary_tier",
    "test_store_load_data_integrity": FS_ONLY
    + "asserts block files on disk; the data, every batch size: "
    "passes: test_tier_contract::test_store_load_data_integrity",
    "test_store_load_roundtrip_without_o_direct": FS_ONLY
    + "the fs tier's buffered-I/O fallback (kvtier copies through shared memory)",
    "test_wait_idle_blocks_until_tasks_complete": FS_ONLY
    + "tests the fs tier's thread pool alone; kvtier's drain: "
    "passes: test_tier_contract::test_reset_cache_waits_for_a_store_in_flight",
    "test_batch_lookup_c_extension": FS_ONLY + "tests vLLM's fs C extension alone",
    "test_batch_lookup_dispatch": RUN + " (the fs dispatch flag it sets does not touch kvtier)",
    "test_out_of_bounds_block_id_smoke": RUN,
    "test_failed_load_corrects_verdict_and_removes_corrupt_file": FS_ONLY
    + "fails the load by truncating a block file; the verdict (vLLM #49176): passes: "
    "test_tier_contract::test_failed_load_is_a_miss_from_get_finished_jobs_on",
    "test_failed_load_after_abort_does_not_break_newer_probe": FS_ONLY
    + "fails the load by removing a block file: passes: "
    "test_tier_contract::test_failed_load_after_its_request_finished_spares_a_newer_lookup",
    "test_batched_partial_load_failure_keeps_loaded_blocks": FS_ONLY
    + "corrupts a block file: passes: test_tier_contract::test_partial_load_keeps_what_arrived",
    "test_batched_load_first_block_fails_marks_whole_batch": FS_ONLY
    + "corrupts a block file, and the fs tier stops at the first bad block while kvtier "
    "keeps every key that arrived: passes: "
    "test_tier_contract::test_load_failing_whole_marks_every_key, "
    "test_tier_contract::test_partial_load_keeps_what_arrived",
    "test_transient_load_failure_leaves_file": FS_ONLY
    + "ELOOP on a block file's open; kvtier deletes nothing on a failed load (the agent "
    "owns its pool), and a failed copy is a miss: passes: "
    "test_tier_contract::test_failed_load_is_a_miss_from_get_finished_jobs_on",
    "test_successful_store_emits_stored_event": FS_ONLY
    + "expects the event at the store job's end with medium STORAGE; kvtier reports what "
    "the agent stored in the namespace (every engine on the node), medium CPU, fetched "
    "after scheduler steps: passes: test_tier_contract::test_stores_reach_vllm_as_events",
    "test_store_event_uses_configured_locality": FS_ONLY
    + "expects None when no locality is configured; kvtier's is LOCAL (the node's memory "
    "is the engine's node's; docs/plugin.md): "
    "passes: test_tier_contract::test_stores_reach_vllm_as_events",
    "test_load_job_emits_no_event": FS_ONLY
    + "takes events without a scheduler step, after which kvtier fetches them, so it "
    "would pass with no event at all: passes: test_tier_contract::test_stores_reach_vllm_as_events",
    "test_mixed_job_results_emit_event_only_for_successful_job": FS_ONLY
    + "injects a failure into the fs tier's writer: "
    "passes: test_tier_contract::test_stores_reach_vllm_as_events",
    "test_partially_failed_store_emits_no_event": FS_ONLY
    + "kvtier's events are what the agent holds: chunks a partly failed job did store are "
    "in the node's pool, usable by every engine, and reported",
    "test_events_disabled_by_default": FS_ONLY + "reads the fs tier's event buffers: passes: "
    "test_tier_contract::test_no_events_and_no_polls_unless_both_switches_are_on",
    "test_events_require_global_kv_events_flag": FS_ONLY
    + "reads the fs tier's event buffers: passes: "
    "test_tier_contract::test_no_events_and_no_polls_unless_both_switches_are_on",
    "test_cascade_store_emits_fs_event_through_tiering_manager": FS_ONLY
    + "picks the tier's events by medium STORAGE (kvtier's are CPU, like the primary "
    "tier's): passes: "
    "test_tier_contract::test_cascade_through_the_manager_surfaces_the_tiers_events",
    "test_fs_tier_cross_tp_round_trip": FS_ONLY
    + "the fs tier's file layout across TP sizes; kvtier shares across TP sizes through "
    "the canonical layout the injected config turns on, and keeps a non-canonical "
    "layout's rows apart by TP size (its fingerprint's layout component, which does not "
    "yet take a replicated layout as independent of TP)",
}

MANAGER = "does not apply: vLLM's manager (or primary tier) logic, with vLLM's example tier "
EXAMPLE = "does not apply: tests vLLM's example tier"
TIERING_OFFLOADING_CASES = {
    "test_tiering_spec_collects_secondary_metric_definitions": "passes: "
    "test_tier_contract::test_stats_as_vllms_metrics_read_them",
    "test_tiering_manager_aggregates_secondary_stats": "passes: "
    "test_tier_contract::test_stats_as_vllms_metrics_read_them",
    "TestExampleSecondaryTierManager::test_basic_store_and_lookup": EXAMPLE,
    "TestExampleSecondaryTierManager::test_config_info_keys_match_the_filled_values": EXAMPLE
    + " (kvtier declares no config-info labels: the base class's empty ones)",
    "test_every_lookup_result_has_a_declared_cascade_behavior": MANAGER,
    "TestTieringOffloadingManager::test_failed_promotion_finalizes_primary_with_failure": (
        "passes (kvtier's failed result, through vLLM's manager): "
        "test_tier_contract::test_failed_promotion_is_not_issued_again"
    ),
    "TestTieringOffloadingManager::test_successful_promotion_finalizes_primary_with_success": (
        "passes: test_plugin::test_store_reset_lookup_promote_byte_identical"
    ),
    "TestTieringOffloadingManager::test_take_events_aggregates_tier_owned_events": "passes: "
    "test_tier_contract::test_cascade_through_the_manager_surfaces_the_tiers_events",
    "TestTieringOffloadingManager::test_basic_store_to_primary": MANAGER,
    "TestTieringOffloadingManager::test_cascade_to_all_secondary_tiers": "passes: "
    "test_plugin::test_store_reset_lookup_promote_byte_identical, "
    "test_tier_contract::test_cascade_through_the_manager_surfaces_the_tiers_events",
    "TestTieringOffloadingManager::test_ref_cnt_protection_during_cascade": MANAGER,
    "TestTieringOffloadingManager::test_lookup_from_primary": MANAGER,
    "TestTieringOffloadingManager::test_promotion_from_secondary": "passes: "
    "test_plugin::test_store_reset_lookup_promote_byte_identical "
    "(its hit source is vLLM 0.33's, derived from kvtier's medium CPU: host)",
    "TestTieringOffloadingManager::test_failed_promotion_keeps_only_successful_chunks": (
        "passes: test_tier_contract::test_failed_promotion_is_not_issued_again"
    ),
    "TestTieringOffloadingManager::test_lookup_reports_sync_delay_for_resolved_lookups": MANAGER,
    "TestTieringOffloadingManager::test_lookup_does_not_report_async_delay_for_promotion": MANAGER,
    "TestTieringOffloadingManager::"
    "test_lookup_reports_async_delay_when_deferred_lookup_resolves": MANAGER,
    "TestTieringOffloadingManager::test_partial_lookup": MANAGER,
    "TestTieringOffloadingManager::test_eviction_in_primary_tier": MANAGER,
    "TestTieringOffloadingManager::test_touch_propagates_to_all_tiers": MANAGER
    + "(kvtier keeps the base class's no-op touch: the agent refreshes recency from the "
    "lookups each step reports)",
    "TestTieringOffloadingManager::test_request_order_survives_late_cascade_completion": MANAGER,
    "TestTieringOffloadingManager::"
    "test_late_old_store_submission_does_not_override_newer_request_order": MANAGER,
    "TestTieringOffloadingManager::test_failed_store_no_cascade": MANAGER,
    "TestTieringOffloadingManager::test_held_promotions_keep_primary_hits": MANAGER,
    "TestTieringOffloadingManager::test_reset_holds_promotions_until_flushed": MANAGER,
    "TestTieringOffloadingManager::test_lookup_batches_submit_load_per_request": MANAGER
    + "(kvtier reads each job's req_context: "
    "test_plugin::test_direct_mode_from_kv_transfer_params)",
    "TestTieringOffloadingManager::test_lookup_shared_chunk_no_duplicate_promotion": MANAGER,
    "TestTieringOffloadingManager::test_complete_store_forwards_req_context_to_submit_store": (
        MANAGER + "(kvtier reads each job's req_context: "
        "test_plugin::test_stores_name_each_chunks_predecessor)"
    ),
    "TestTieringOffloadingManager::"
    "test_on_request_finished_delays_only_secondary_until_store_submitted": MANAGER,
    "TestTieringOffloadingManager::test_failed_store_finalizes_finished_request": MANAGER,
    "TestTieringOffloadingManager::test_zero_store_request_finalizes_immediately": MANAGER,
    "TestTieringOffloadingManager::test_reset_cache_finalizes_delayed_secondary_request": MANAGER,
    "TestTieringOffloadingManager::"
    "test_reset_cache_clears_pending_primary_stores_for_active_request": MANAGER,
    "TestTieringOffloadingManager::test_on_new_request_lifecycle": MANAGER
    + "(kvtier asks for the default, chunk-level offloading)",
    "TestTieringOffloadingManager::"
    "test_prepare_store_cascades_existing_chunks_to_request_level_tiers": MANAGER
    + "(request-level tiers only; kvtier is chunk-level)",
    "TestTieringOffloadingManager::test_cascade_rejects_retry_from_primary": MANAGER
    + "(the cascade to tiers serving external requests; kvtier serves none)",
    "TestTieringOffloadingManager::test_cascade_defers_keys_whose_primary_write_is_in_flight": (
        MANAGER + "(the cascade to tiers serving external requests; kvtier serves none)"
    ),
    "TestTieringOffloadingManager::test_deferred_cascade_holds_request_from_finalization": (
        MANAGER + "(the cascade to tiers serving external requests; kvtier serves none)"
    ),
    "TestTieringOffloadingManager::test_cascade_drops_deferred_keys_whose_primary_write_failed": (
        MANAGER + "(the cascade to tiers serving external requests; kvtier serves none)"
    ),
    "TestTieringOffloadingManager::test_reset_cache_clears_orchestrator_state": MANAGER,
    "TestTieringOffloadingManager::test_reset_cache_drains_all_tiers": "passes: "
    "test_tier_contract::test_reset_cache_waits_for_a_store_in_flight",
    "TestTieringOffloadingManager::test_tier_filter_skips_filtered_secondary": MANAGER
    + "(a filter picks tiers by medium: kvtier's is CPU)",
    "TestTieringOffloadingManager::test_tier_filter_allows_matching_secondary": MANAGER
    + "(a filter picks tiers by medium: kvtier's is CPU)",
    "TestTieringOffloadingWithoutSecondaryTiers::test_works_without_secondary_tiers": (
        "does not apply: a manager with no secondary tier"
    ),
    "test_parse_tier_filter_valid": MANAGER,
    "test_parse_tier_filter_invalid_returns_all": MANAGER,
    "test_parse_tier_filter_skips_bad_entries": MANAGER,
    "test_tiering_manager_reports_one_config_info_series_for_each_tier": MANAGER
    + "(kvtier declares no config-info labels)",
    "test_tiering_manager_reports_the_primary_series_with_no_secondary_tier": MANAGER,
    "test_tiering_manager_rejects_a_primary_tier_with_two_info_mappings": MANAGER,
    "test_tiering_manager_keeps_the_tier_label_out_of_the_tier_mapping": MANAGER,
    "test_tiering_spec_declares_the_config_info_keys_the_manager_fills": MANAGER,
    "test_tiering_spec_passes_each_tier_its_own_config": MANAGER
    + "(kvtier's own parameters reach it: test_tier_contract::test_the_factory_forwards_locality)",
    "test_tiering_spec_rejects_a_tier_that_declares_the_reserved_tier_label": MANAGER,
}


def published_cases(path: Path) -> list[str]:
    """The test cases a published file defines: functions, and Class::method."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            names.append(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            names += [
                f"{node.name}::{m.name}"
                for m in node.body
                if isinstance(m, ast.FunctionDef) and m.name.startswith("test_")
            ]
    return names


class KVTierInPlaceOfFs(KVTierSecondaryTier):
    """kvtier's tier, built from the arguments vLLM's fs tests give their tier."""

    endpoint = ""  # the module's agent

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str,
        n_read_threads: int = 16,
        n_write_threads: int = 16,
        enable_kv_events: bool = False,
        locality: str | None = None,
        backpressure_detector: Any = None,
    ) -> None:
        super().__init__(
            offloading_spec,
            primary_kv_view,
            tier_type,
            agent=self.endpoint,
            copy_threads=max(n_read_threads, n_write_threads),
            enable_kv_events=enable_kv_events,
            locality=locality,
            scope=root_dir,
            backpressure_detector=backpressure_detector,
        )

    @property
    def _lookup_manager(self) -> Any:
        """The name the tests' lookup helper polls vLLM's async-lookup helper by."""
        return self._lookup


def load_fs_tests() -> ModuleType | None:
    path = TIERING / "test_fs_tier.py"
    if not (PUBLISHED / ".complete").exists():
        return None
    spec = importlib.util.spec_from_file_location("vllm_published.test_fs_tier", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.FileSystemTierManager = KVTierInPlaceOfFs  # type: ignore[attr-defined]
    return module


fs_tests = load_fs_tests()
if fs_tests is not None:  # the published cases and their fixtures, as this module's
    for _name in [n for n, verdict in FS_TIER_CASES.items() if verdict.startswith(RUN)]:
        globals()[_name] = getattr(fs_tests, _name)
    fs_tier = fs_tests.fs_tier
    fs_tier_with_events = fs_tests.fs_tier_with_events


@pytest.fixture(scope="module", autouse=True)
def published_agent() -> Iterator[None]:
    if fs_tests is None:
        pytest.fail(
            f"vLLM 0.33's published tests are not at {PUBLISHED}: `make test` extracts them "
            "(tools/fetch_vllm_tests.py)"
        )
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-published-", dir="/dev/shm"))
    config = parse_config(
        config_data(scratch, chunkBytes=FS_ROW, capacity=24 * (FS_ROW + 4096) + 4096)
    )
    agent = AgentProcess(config, python=AGENT_PYTHON).start()
    KVTierInPlaceOfFs.endpoint = config.endpoint
    yield
    agent.stop()
    shutil.rmtree(scratch, ignore_errors=True)


@pytest.mark.parametrize(
    ("published", "cases"),
    [("test_fs_tier.py", FS_TIER_CASES), ("test_tiering_offloading.py", TIERING_OFFLOADING_CASES)],
    ids=["fs_tier", "tiering_offloading"],
)
def test_every_published_case_is_accounted_for(published: str, cases: dict[str, str]) -> None:
    """A case vLLM adds (or renames) must be classified here before this passes."""
    assert sorted(published_cases(TIERING / published)) == sorted(cases)


def test_each_answer_names_a_test_that_exists() -> None:
    defined = {
        f"{path.stem}::{node.name}"
        for path in Path(__file__).parent.glob("test_*.py")
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.FunctionDef)
    }
    for case, verdict in {**FS_TIER_CASES, **TIERING_OFFLOADING_CASES}.items():
        assert verdict.startswith((RUN, "passes", "does not apply: ")), case
        named = re.findall(r"test_\w+::test_\w+", verdict)
        assert set(named) <= defined, (case, set(named) - defined)
        if "passes" in verdict:
            assert named, case
