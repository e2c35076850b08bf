"""gs:// end to end against a local GCS emulator that this test starts and stops: data read
from a bucket, a run whose --output_dir is in the bucket (Orbax through tensorstore's gcs
driver, metrics and config through gcsfs), resume by re-running, and eval from there."""

import json
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from conftest import cli_env, run_cli

BUCKET = "meshlm-test"

# gcp-storage-emulator, plus the response headers tensorstore needs: real GCS sends an
# object's generation with its bytes (x-goog-generation); the emulator does not, and
# tensorstore's conditional writes (OCDBT's manifest) then fail with "Malformed
# StorageGeneration". (The emulator also ignores ifGenerationMatch: fine, one writer.)
EMULATOR = """
import http.server, sys
from gcp_storage_emulator import server
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

plain = objects.download

def download(request, response, storage, *args, **kwargs):
    plain(request, response, storage, *args, **kwargs)
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except NotFound:
        return
    response["x-goog-generation"] = obj["generation"]
    response["x-goog-metageneration"] = obj["metageneration"]

objects.download = download  # objects.get(alt=media) calls it by this name
server.HANDLERS = tuple((rx, {m: download if h is plain else h for m, h in hs.items()})
                        for rx, hs in server.HANDLERS)
http.server.HTTPServer.request_queue_size = 256  # tensorstore opens many connections at once
server.create_server("127.0.0.1", int(sys.argv[1]), in_memory=True,
                     default_bucket=sys.argv[2]).run()
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """The emulator's URL; stopped (and its in-memory bucket gone) after the module."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("gcs") / "emulator.log"
    with open(log_path, "w") as log:  # a file, not a pipe nobody drains: that would block it
        proc = subprocess.Popen([sys.executable, "-c", EMULATOR, str(port), BUCKET],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/", timeout=1).read()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("the GCS emulator did not start:\n"
                                       + log_path.read_text()[-2000:]) from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def gcs_env(url):
    return cli_env(1, STORAGE_EMULATOR_HOST=url,  # gcsfs and google-cloud-storage
                   TENSORSTORE_GCS_HTTP_URL=url,  # tensorstore, under Orbax
                   GOOGLE_AUTH_TOKEN_FOR_TESTING="emulator",  # tensorstore: no credential hunt
                   GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")


def upload(url, name, data):
    request = urllib.request.Request(
        f"{url}/upload/storage/v1/b/{BUCKET}/o?uploadType=media&name={urllib.parse.quote(name)}",
        data=data, method="POST", headers={"Content-Type": "application/octet-stream"})
    urllib.request.urlopen(request).read()


def download(url, name):
    quoted = urllib.parse.quote(name, safe="")
    return urllib.request.urlopen(f"{url}/storage/v1/b/{BUCKET}/o/{quoted}?alt=media").read()


def names(url, prefix):
    query = urllib.parse.urlencode({"prefix": prefix})
    listing = json.load(urllib.request.urlopen(f"{url}/storage/v1/b/{BUCKET}/o?{query}"))
    return sorted(item["name"] for item in listing.get("items", []))


@pytest.mark.slow
def test_train_resume_and_eval_on_gcs(gcs, tmp_path):
    from pydoc_data.topics import topics
    upload(gcs, "data/corpus.txt", "\n\n".join(topics[k] for k in sorted(topics)[:40]).encode())
    run, data_path = f"gs://{BUCKET}/run", f"gs://{BUCKET}/data/corpus.txt"
    args = ["--seq_len=32", "--batch_size=8", "--model.num_hidden_layers=2", "--eval_every=0",
            "--eval_batches=2", "--log_every=1", "--save_every=2", f"--data.path={data_path}",
            f"--data.cache_dir={tmp_path / 'cache'}", f"--output_dir={run}"]
    env = gcs_env(gcs)

    first = run_cli("train", *args, "--steps=4", env=env, timeout=300)
    assert f"done: 4 steps; checkpoint in {run}/checkpoints/4" in first.stdout
    stored = names(gcs, "run/")
    assert {"run/config.json", "run/metrics.jsonl", "run/checkpoints/4/commit_success.txt"} \
        <= set(stored)
    assert any(n.startswith("run/checkpoints/4/params/") for n in stored)

    # What a save killed half-way leaves on GCS: a step dir without its commit marker.
    upload(gcs, "run/checkpoints/5/params/manifest.ocdbt", b"half written")
    upload(gcs, "run/checkpoints/5/meta/metadata", b"{}")
    refused = run_cli("eval", f"--checkpoint={run}/checkpoints/5", f"--data={data_path}",
                      env=env, check=False, timeout=300)
    assert refused.returncode == 1 and refused.stderr.strip().splitlines()[-1].startswith(
        f"error: {run}/checkpoints/5 is an unfinished checkpoint")
    second = run_cli("train", *args, "--steps=6", env=env, timeout=300)
    assert f"resuming from step 4 of {run}\n" in second.stdout  # not from the unfinished 5
    assert f"done: 6 steps; checkpoint in {run}/checkpoints/6" in second.stdout
    assert not names(gcs, "run/checkpoints/5/")  # cleaned up by the resuming run
    metrics = [json.loads(line) for line in download(gcs, "run/metrics.jsonl").splitlines()]
    assert [r["step"] for r in metrics] == list(range(7))

    out = run_cli("eval", f"--checkpoint={run}", f"--data={data_path}", "--seq_len=32",
                  "--max_batches=2", f"--cache_dir={tmp_path / 'cache'}", env=env,
                  timeout=300).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["tokens"] > 0 and 0 < result["loss"] < 10
