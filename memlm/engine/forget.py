"""Forgetting a document: hidden from search and builds, gone from the statistics."""

from __future__ import annotations

from memlm.engine.core import EngineCore


class ForgetMixin(EngineCore):
    """``forget_document`` and ``hide_documents``."""

    def forget_document(
        self, doc_id: int, text: str | None = None, *, entries: range | None = None
    ) -> int:
        """Hide every entry of a document from search and from later builds.

        Its held-out tokens leave the calibrator's pending records and training set too.
        With its ``text`` its tokens also leave the lexical statistics (once: a retry
        after a crash takes nothing out twice); the snapshot beside the index version
        served now keeps them until the next build, which compacts the datastore (the
        keys leave the disk) and deletes every older index version (see ``rebuild``).
        ``entries``: the id range the database recorded for it, where the memory gave
        one, so that only that range is read (``MemoryBackend.delete_document``).
        """
        self._check_writer()
        ids = None if text is None else self.encoder.tokenize(text)
        with self.exclusive(), self._write_lock:
            hidden = self.memory.delete_document(doc_id, entries=entries)
            if ids is not None:
                self.calibration.forget(ids, doc_id)
        self.heldout.drop_document(doc_id)
        with self.building():  # the training set has the builder's lock
            self.calibration.drop_document(doc_id)
        return hidden

    def hide_documents(self, doc_ids: list[int]) -> int:
        """Stop serving these documents' entries now, before the writer deletes them (a
        forget requested, not yet applied; ``MemoryBackend.hide_documents``)."""
        return self.memory.hide_documents(doc_ids)
