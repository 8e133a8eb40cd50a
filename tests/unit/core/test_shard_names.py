from airflow_provider_vllm.core.shard_names import shard_display_names, with_display_names


def test_contiguous_shards_name_their_index_count_and_row_range():
    shards = [{"shard_id": f"s{i}", "index": i, "rows": r, "bucket": "all"} for i, r in enumerate([400, 400, 3])]
    assert shard_display_names(shards) == ["shard 0/3 rows 0-399", "shard 1/3 rows 400-799", "shard 2/3 rows 800-802"]
    named = with_display_names(shards)
    assert [s["name"] for s in named] == shard_display_names(shards) and named[0]["shard_id"] == "s0"
    assert "name" not in shards[0]  # the input is not modified


def test_bucketed_shards_name_their_bucket_and_size_and_empty_lists_name_nothing():
    shards = [{"index": 0, "rows": 10, "bucket": "short"}, {"index": 1, "rows": 2, "bucket": "long"}]
    assert shard_display_names(shards) == ["shard 0/2 short, 10 rows", "shard 1/2 long, 2 rows"]
    assert shard_display_names([]) == []
