"""The hub corpus stream resumes: a corpus job killed mid-stream continues after its last written part, and writes
the file (documents and row groups) and counts of an uninterrupted pass."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cramswarm.data import hub, sources, stream


def hub_folder(root, name: str, shards: int, rows: int):
    """A local dataset in hub layout: ``shards`` parquet files of ``rows`` documents (one of them empty)."""
    folder = root / name / "data"
    folder.mkdir(parents=True)
    for shard in range(shards):
        texts = [f"{name} shard {shard} document {i} " + "word " * (i % 7) for i in range(rows)]
        texts[3] = "   "  # an empty document, dropped and counted
        pq.write_table(pa.table({"text": texts}), folder / f"train-{shard:05d}-of-{shards:05d}.parquet")
    return str(root / name)


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """Two sources (the first capped at 130 documents), row groups of 10 documents, parts of 2 row groups."""
    monkeypatch.setattr(stream, "MAX_ROW_GROUP_DOCUMENTS", 10)
    monkeypatch.setattr(sources, "PART_ROW_GROUPS", 2)
    return [{"path": hub_folder(tmp_path, "first", 3, 60), "max_documents": 130},
            {"path": hub_folder(tmp_path, "second", 2, 40)}]


def test_a_stream_built_from_a_state_continues_after_it(corpus):
    everything = list(hub.CorpusStream(corpus))
    assert len(everything) == 130 + 80
    for cut in (1, 59, 60, 129, 130, 175):  # within a shard, at a shard's and at a source's end, in the second
        first = hub.CorpusStream(corpus)
        documents = iter(first)
        head = [next(documents) for _ in range(cut)]
        rest = list(hub.CorpusStream(corpus, state=first.state()))
        assert head + rest == everything, cut


class Killed(Exception):
    pass


def test_a_killed_corpus_job_resumes_after_its_last_part_to_the_same_file(corpus, tmp_path):
    whole = sources.write_corpus_resumable(lambda state: hub.CorpusStream(corpus, state=state),
                                           tmp_path / "whole.parquet", tmp_path / "state-whole", "spec")
    assert not (tmp_path / "state-whole").exists()
    assert whole == sources.write_corpus(hub.iter_corpus(corpus), tmp_path / "plain.parquet")  # the same counts
    assert whole["documents"] == 210 - 5 and whole["empty_documents_dropped"] == 5

    pulled = []

    def counted(limit):
        def make(state):
            class Counted(hub.CorpusStream):
                def __iter__(self):
                    for n, doc in enumerate(super().__iter__()):
                        if limit is not None and n == limit:
                            raise Killed
                        pulled.append(doc)
                        yield doc
            return Counted(corpus, state=state)
        return make

    state = tmp_path / "state"
    with pytest.raises(Killed):  # killed inside the fourth part (parts of 20 documents)
        sources.write_corpus_resumable(counted(75), tmp_path / "out.parquet", state, "spec")
    assert not (tmp_path / "out.parquet").exists() and (state / "progress.json").is_file()
    before = len(pulled)
    resumed = sources.write_corpus_resumable(counted(None), tmp_path / "out.parquet", state, "spec")
    assert resumed == whole and not state.exists()
    assert len(pulled) - before < 210 - 60  # streamed again from the last part (3 x 20 documents kept), not from 0
    for name in ("whole", "out", "plain"):  # the same documents in the same row groups
        reader = pq.ParquetFile(tmp_path / f"{name}.parquet")
        groups = [reader.read_row_group(g)["text"].to_pylist() for g in range(reader.num_row_groups)]
        if name == "whole":
            expected = groups
        assert groups == expected, name


def test_a_state_of_another_spec_is_not_resumed(corpus, tmp_path):
    state = tmp_path / "state"
    with pytest.raises(Killed):
        def stop(state_):
            class Stop(hub.CorpusStream):
                def __iter__(self):
                    for n, doc in enumerate(super().__iter__()):
                        if n == 50:
                            raise Killed
                        yield doc
            return Stop(corpus, state=state_)
        sources.write_corpus_resumable(stop, tmp_path / "a.parquet", state, "spec-a")
    counts = sources.write_corpus_resumable(lambda s: hub.CorpusStream(corpus, state=s), tmp_path / "b.parquet",
                                            state, "spec-b")
    assert counts["documents"] == 205  # from the start: the other spec's parts were thrown away
