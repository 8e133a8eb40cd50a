from airflow_provider_vllm.core.plan import ShardSummary
from airflow_provider_vllm.core.shard_names import shard_display_names, with_display_names


def summary(i: int, rows: int, bucket: str = "all") -> ShardSummary:
    return ShardSummary(shard_id=f"shard-{i:05d}-0000abcd", index=i, rows=rows, est_tokens=rows * 9, bucket=bucket)


def test_contiguous_shards_name_their_index_count_and_row_range():
    shards = [summary(i, r) for i, r in enumerate([400, 400, 3])]
    assert shard_display_names(shards) == ["shard 0/3 rows 0-399", "shard 1/3 rows 400-799", "shard 2/3 rows 800-802"]
    named = with_display_names(shards)
    assert [s.name for s in named] == shard_display_names(shards) and named[0].shard_id == "shard-00000-0000abcd"
    assert shards[0].name is None  # the input is not modified


def test_bucketed_shards_name_their_bucket_and_size_and_empty_lists_name_nothing():
    shards = [summary(0, 10, "short"), summary(1, 2, "long")]
    assert shard_display_names(shards) == ["shard 0/2 short, 10 rows", "shard 1/2 long, 2 rows"]
    assert shard_display_names([]) == []
