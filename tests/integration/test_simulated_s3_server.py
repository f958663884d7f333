"""The benchmarks' S3 server: ranges cost their slice, bodies are mapped from files, not copied."""

import os

import pytest

from sparkgpu.testing import simulated_s3

pytestmark = pytest.mark.integration

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto")


@pytest.fixture
def s3():
    server, endpoint = simulated_s3.start_s3_server()
    try:
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=simulated_s3._KEY,
            aws_secret_access_key=simulated_s3._SECRET,
            region_name="us-east-1",
        )
        client.create_bucket(Bucket="shards")
        yield server, client
    finally:
        server.terminate()
        server.wait(timeout=10)


def _mapped_files(pid: int) -> dict[str, int]:
    """Bytes of each file mapped into the process (a deleted temporary file included)."""
    sizes: dict[str, int] = {}
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            name = fields[5].strip() if len(fields) == 6 else ""
            if name:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                sizes[name] = sizes.get(name, 0) + end - start
    return sizes


def test_ranges_and_whole_gets_return_the_bytes_written(s3, tmp_path):
    server, client = s3
    shard = os.urandom(20 << 20)  # over boto3's multipart threshold and moto's in-memory limit
    (tmp_path / "shard").write_bytes(shard)
    client.upload_file(str(tmp_path / "shard"), "shards", "a/shard.mds")
    client.put_object(Bucket="shards", Key="a/index.json", Body=b'{"shards": []}')

    def get(key, range_=None):
        extra = {"Range": range_} if range_ else {}
        return client.get_object(Bucket="shards", Key=key, **extra)["Body"].read()

    assert get("a/shard.mds", "bytes=1000-5000999") == shard[1000:5001000]
    assert get("a/shard.mds", "bytes=-10") == shard[-10:]
    assert get("a/shard.mds") == shard
    assert get("a/index.json", "bytes=2-7") == b"shards"
    assert get("a/index.json") == b'{"shards": []}'

    # The large body is served from a map of moto's temporary file, not a copy on the heap.
    mapped = _mapped_files(server.pid)
    assert any(size >= len(shard) and "(deleted)" in name for name, size in mapped.items()), mapped

    client.copy_object(Bucket="shards", Key="b/shard.mds", CopySource={"Bucket": "shards", "Key": "a/shard.mds"})
    assert get("b/shard.mds", "bytes=0-9") == shard[:10]
    client.put_object(Bucket="shards", Key="a/shard.mds", Body=b"replaced")
    assert get("a/shard.mds") == b"replaced"
    assert get("b/shard.mds", "bytes=-4") == shard[-4:]
