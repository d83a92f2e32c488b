"""Serving: the interpolation that matches the active index version.

:class:`ServedInterpolation` is what one served index version answers with (the constant,
the calibrator when it beat it, the gate); :class:`ServedCalibration` owns the files of an
engine's data directory (lexical statistics, the held-out training set, the per-version
models) and loads the served interpolation for a version.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from memlm.calibrator import evidence as evidence_files
from memlm.calibrator import retrain as build_time
from memlm.calibrator.combined import calibrator_lambdas, combine, from_calibrator
from memlm.calibrator.evidence import PRIOR, EvidenceModel
from memlm.calibrator.features import TOP_N, token_features
from memlm.calibrator.heldout_set import TRAIN_FILE, HeldoutSet, file_stamp
from memlm.calibrator.model import CALIBRATOR_DIR, Calibrator, CalibratorConfig
from memlm.calibrator.retrain import GATE_DIR, saved_versions
from memlm.knnlm import KnnParams
from memlm.knnlm.policy import TokenScores, token_scores

if TYPE_CHECKING:
    from memlm.calibrator.constant import ConstantChoice, TuneGrid
    from memlm.calibrator.lexical import LexicalStats
    from memlm.encoder import Encoder, TokenOutputs


@dataclass(frozen=True)
class ServedInterpolation:
    """The interpolation one served index version answers and decides with.

    ``params``: k and T of p_kNN, and the constant lambda when neither of the per-token
    sources is served; ``evidence``: lambda per token from the retrieval evidence
    (memlm.calibrator.evidence; None when the settings fix lambda); ``calibrator``: lambda
    per token, used only when it beat the evidence (or the constant) on the same validation
    tokens (``use_calibrator``); ``gate``: skips the search where its lambda is below
    ``theta``.  The engine reads it once per call and the
    loader replaces it whole, so a call never mixes two versions' parameters.
    """

    params: KnnParams
    version: int | None = None  # the index version it was loaded for
    record: dict[str, Any] = field(default_factory=dict)  # interpolation.json ({}: none yet)
    calibrator: Calibrator | None = None  # the newest calibrator at or below ``version``
    calibrator_version: int | None = None  # the version directory it was loaded from
    use_calibrator: bool = False
    gate: Calibrator | None = None
    theta: float = 0.0
    lexical: LexicalStats | None = None  # what the calibrator's lexical features read
    evidence: EvidenceModel | None = None
    # the T the calibrator was trained at (the constant's at its build): in the combination
    # a token whose lambda is the calibrator's mixes p_kNN at this T (None: params')
    calibrator_temperature: float | None = None

    @property
    def lambda_source(self) -> str:
        """``combined`` (max of the evidence's and the calibrator's lambda), ``calibrator``
        (the settings fix lambda and it beat the constant), ``evidence`` or ``constant``."""
        if self.use_calibrator and self.calibrator is not None:
            return "combined" if self.evidence is not None else "calibrator"
        return "evidence" if self.evidence is not None else "constant"

    @property
    def uses_calibrator(self) -> bool:
        """The calibrator's lambda takes part (alone or in the combination)."""
        return self.lambda_source in ("calibrator", "combined")

    def gate_mask(
        self, top_logprob: np.ndarray, entropy: np.ndarray, prev_tokens: np.ndarray
    ) -> np.ndarray:
        """(m,) bool: search these tokens (all of them without a gate or with theta 0)."""
        if self.gate is None or self.theta <= 0 or self.lexical is None:
            return np.ones(len(top_logprob), bool)
        pre = token_features(top_logprob, entropy, self.lexical.features(prev_tokens))
        return self.gate.predict({n: pre[n] for n in self.gate.cfg.features}) >= self.theta

    def calibrated(
        self,
        top_logprob: np.ndarray,
        entropy: np.ndarray,
        prev_tokens: np.ndarray,
        distances: np.ndarray,
        values: np.ndarray,
    ) -> np.ndarray | None:
        """(m,) lambda from the served calibrator alone, None when it takes no part."""
        if not self.uses_calibrator or self.lexical is None:
            return None
        assert self.calibrator is not None
        lex = self.lexical.features(prev_tokens)
        return calibrator_lambdas(self.calibrator, top_logprob, entropy, lex, distances, values)

    def token_mix(
        self,
        top_logprob: np.ndarray,
        entropy: np.ndarray,
        prev_tokens: np.ndarray,
        distances: np.ndarray,
        values: np.ndarray,
        qnorm: np.ndarray,
        context: np.ndarray | None = None,
        stats: LexicalStats | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(m,) lambda and (m,) kNN temperature of each token before the gate
        (:meth:`mix_of`), the lexical features read from ``stats`` (None: the served
        statistics)."""
        stats = self.lexical if stats is None else stats
        lex = None
        if self.uses_calibrator and stats is not None:
            lex = stats.features(prev_tokens)
        return self.mix_of(top_logprob, entropy, lex, distances, values, qnorm, context)

    def token_lambdas(
        self,
        top_logprob: np.ndarray,
        entropy: np.ndarray,
        prev_tokens: np.ndarray,
        distances: np.ndarray,
        values: np.ndarray,
        qnorm: np.ndarray,
        context: np.ndarray | None = None,
    ) -> np.ndarray:
        """(m,) lambda of each token before the gate (:meth:`token_mix`)."""
        return self.token_mix(top_logprob, entropy, prev_tokens, distances, values, qnorm, context)[
            0
        ]

    def mix_of(
        self,
        top_logprob: np.ndarray,
        entropy: np.ndarray,
        lexical: np.ndarray | None,
        distances: np.ndarray,
        values: np.ndarray,
        qnorm: np.ndarray,
        context: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(m,) lambda and (m,) kNN temperature of each token before the gate.

        Lambda: the combination's (the larger of the evidence's and the calibrator's), the
        calibrator's, the evidence's or the constant.  T: ``params.temperature``, except
        where the combination takes the calibrator's lambda: there the T it was trained
        at, so each source mixes p_kNN as it was fitted (memlm.calibrator.combined).
        distances, values: (m, >= params.k, and >= 10 where the calibrator takes part)
        search results sorted by distance; qnorm: (m,) squared norm of each query key;
        context: (m,) tokens of context before each predicted token (None: long);
        lexical: (m, 2) the lexical features (None: the calibrator cannot be asked, the
        evidence or the constant answers)."""
        k = self.params.k
        temps = np.full(len(top_logprob), float(self.params.temperature))
        ev = None
        if self.evidence is not None:
            ev = self.evidence.lambdas(
                distances[:, :k], values[:, :k], qnorm, self.params.temperature, context
            )
        if self.uses_calibrator and lexical is not None:
            assert self.calibrator is not None
            cal = calibrator_lambdas(
                self.calibrator, top_logprob, entropy, lexical, distances, values
            )
            if ev is None:
                return cal, temps
            t_cal = self.calibrator_temperature or self.params.temperature
            return combine(ev, cal), np.where(from_calibrator(ev, cal), t_cal, temps)
        if ev is not None:
            return ev, temps
        return np.full(len(top_logprob), self.params.lmbda), temps

    def lambdas_of(
        self,
        top_logprob: np.ndarray,
        entropy: np.ndarray,
        lexical: np.ndarray | None,
        distances: np.ndarray,
        values: np.ndarray,
        qnorm: np.ndarray,
        context: np.ndarray | None = None,
    ) -> np.ndarray:
        """(m,) lambda of each token before the gate (:meth:`mix_of`)."""
        return self.mix_of(top_logprob, entropy, lexical, distances, values, qnorm, context)[0]

    def mix(
        self,
        top_logprob: np.ndarray,
        entropy: np.ndarray,
        prev_tokens: np.ndarray,
        distances: np.ndarray,
        values: np.ndarray,
        qnorm: np.ndarray,
        context: np.ndarray | None = None,
        stats: LexicalStats | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(m,) lambda (0 where the gate skips the search) and (m,) T of each token;
        ``stats``: the lexical statistics the calibrator reads (None: the served ones)."""
        lam, temps = self.token_mix(
            top_logprob, entropy, prev_tokens, distances, values, qnorm, context, stats
        )
        return np.where(self.gate_mask(top_logprob, entropy, prev_tokens), lam, 0.0), temps

    def lambdas(
        self,
        top_logprob: np.ndarray,
        entropy: np.ndarray,
        prev_tokens: np.ndarray,
        distances: np.ndarray,
        values: np.ndarray,
        qnorm: np.ndarray,
        context: np.ndarray | None = None,
    ) -> np.ndarray:
        """(m,) lambda of each token (:meth:`mix`)."""
        return self.mix(top_logprob, entropy, prev_tokens, distances, values, qnorm, context)[0]

    def scores(
        self,
        encoder: Encoder,
        out: TokenOutputs,
        search: Callable[[int], tuple[np.ndarray, np.ndarray, np.ndarray]],
        lexical: LexicalStats | None = None,
    ) -> tuple[TokenScores, np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The augmented model's scores of one document under this interpolation: what
        /score answers and what MoNIM decides with, in the service's worker and in
        ``memlm eval --lambda served`` alike.

        ``search(width)``: (distances, ids, values) of the document's tokens, ``width``
        columns sorted by distance (``max(k, TOP_N)`` where the calibrator takes part: its
        density features read the top 10); ``lexical``: the statistics the calibrator's
        lexical features read (None: the served ones).  Returns the scores, lambda (0 where
        the gate skips the search) and T per token, and the search cut to k columns."""
        k = self.params.k
        dist, ids, vals = search(max(k, TOP_N) if self.uses_calibrator else k)
        qnorm = (out.keys.astype(np.float64) ** 2).sum(axis=1)
        lam, temps = self.mix(
            out.top_logprob, out.entropy, out.prev_tokens, dist, vals, qnorm, out.positions, lexical
        )
        dist, ids, vals = dist[:, :k], ids[:, :k], vals[:, :k]
        scores = token_scores(encoder, out, dist, vals, self.params, lmbda=lam, temperature=temps)
        return scores, lam, temps, (dist, ids, vals)

    def to_json(self) -> dict[str, Any]:
        """What /admin/stats shows: the served constant, where it came from, lambda's source."""
        rec = self.record
        return {
            "index_version": self.version,
            "chosen_for": rec.get("index_version"),
            "k": self.params.k,
            "temperature": self.params.temperature,
            "lambda": self.params.lmbda,
            "source": rec.get("source", "default"),
            "lambda_source": self.lambda_source,
            "evidence": None if self.evidence is None else self.evidence.to_json(),
            "heldout_tokens": rec.get("tokens", 0),
            "heldout_ppl": rec.get("ppl"),
            "heldout_bare_ppl": rec.get("bare_ppl"),
            "calibrator_val_ppl": _exp((rec.get("calibrator") or {}).get("val_nll")),
            "constant_val_ppl": _exp((rec.get("calibrator") or {}).get("constant_val_nll")),
        }


def _exp(nll: float | None) -> float | None:
    return None if nll is None else float(math.exp(nll))


class ServedCalibration:
    """Lexical statistics, the held-out training set and the per-version interpolation.

    Files (``data_dir`` of an engine): ``lexical.npz`` (updated after every ingested
    document), ``calibrator-train.npz`` (every held-out token merged so far, with the index
    version it was merged for), and, beside each index build ``index/v000042/``:
    ``lexical.npz`` (the statistics the build saw), ``calibrator/`` and ``gate/`` (trained
    for that version) and ``interpolation.json`` (the constant chosen at that build and
    whether the calibrator beat it).  A process that serves version v loads v's files, or
    the newest older ones when v has none yet, as one :class:`ServedInterpolation`
    (``served``); before any build chose one it serves ``default``.
    """

    def __init__(
        self,
        data_dir: Path,
        vocab_size: int,
        *,
        theta: float = 0.0,
        shared: bool = False,
        default: KnnParams | None = None,
        evidence: bool = False,
    ):
        from memlm.calibrator.constant import SERVED_DEFAULT
        from memlm.calibrator.lexical import LexicalStats

        self.data_dir = Path(data_dir)
        # shared: other writer processes update lexical.npz and the training set too, so
        # both are re-read when their file changed (lexical updates run under the
        # datastore's write lock, training-set writes under the build lock)
        self.shared = shared
        self._lexical_stat = file_stamp(self.lexical_path)
        self.lexical = LexicalStats.load(self.lexical_path, vocab_size)
        self.vocab_size = vocab_size
        self.default = default or SERVED_DEFAULT
        # lambda per token from the retrieval evidence (the prior until a build fits it);
        # False when the settings fix lambda: the constant is served as it is
        self.use_evidence = evidence
        self.served = ServedInterpolation(
            self.default,
            theta=theta,
            lexical=self.lexical,
            evidence=PRIOR if evidence else None,
        )
        # what ``served`` was loaded from: (version, calibrator stamp, interpolation stamp)
        self._loaded: tuple[Any, ...] | None = None
        self.heldout = HeldoutSet(self.data_dir / TRAIN_FILE)

    # The served version's parts, read from ``served`` (one consistent snapshot).
    @property
    def calibrator(self) -> Calibrator | None:
        """The calibrator that takes part in lambda now, alone or combined (None: it does not)."""
        s = self.served
        return s.calibrator if s.uses_calibrator else None

    @property
    def gate(self) -> Calibrator | None:
        return self.served.gate

    @property
    def theta(self) -> float:
        return self.served.theta

    @theta.setter
    def theta(self, value: float) -> None:
        self.served = replace(self.served, theta=value)

    @property
    def version(self) -> int | None:
        return self.served.version

    @property
    def loaded_version(self) -> int | None:
        """The version directory the served calibrator came from (None: constant)."""
        return self.served.calibrator_version if self.calibrator is not None else None

    @property
    def served_lexical(self) -> LexicalStats:
        return self.served.lexical or self.lexical

    @property
    def train_path(self) -> Path:
        return self.heldout.path

    @property
    def lexical_path(self) -> Path:
        return self.data_dir / "lexical.npz"

    def refresh_lexical(self) -> bool:
        """Shared writers: re-read the lexical statistics if another process saved them."""
        from memlm.calibrator.lexical import LexicalStats

        stat = file_stamp(self.lexical_path)
        if not self.shared or stat == self._lexical_stat:
            return False
        fresh = LexicalStats.load(self.lexical_path, self.vocab_size)
        if self.served.lexical is self.lexical:
            self.served = replace(self.served, lexical=fresh)
        self.lexical, self._lexical_stat = fresh, stat
        return True

    def observe(self, token_ids: Sequence[int], doc_id: int | None = None) -> bool:
        """Count one ingested document's tokens once and persist; False if counted before."""
        ids = np.asarray(token_ids, np.int64)
        return self._change_lexical(lambda lex: lex.update(ids, doc_id))

    def forget(self, token_ids: Sequence[int], doc_id: int) -> bool:
        """Take a forgotten document's tokens out of the statistics; False if not counted."""
        ids = np.asarray(token_ids, np.int64)
        return self._change_lexical(lambda lex: lex.remove(ids, doc_id))

    def _change_lexical(self, change: Callable[[LexicalStats], bool]) -> bool:
        """Apply ``change`` to the newest saved statistics; save them if it changed them."""
        self.refresh_lexical()
        if not change(self.lexical):
            return False
        self.lexical.save(self.lexical_path)
        self._lexical_stat = file_stamp(self.lexical_path)
        return True

    def snapshot(self, index_root: Path, version: int) -> None:
        """Save the lexical statistics beside a new index build."""
        self.refresh_lexical()
        self.lexical.save(Path(index_root) / f"v{version:06d}" / "lexical.npz")

    def load_for(self, index_root: Path, version: int | None) -> bool:
        """Serve the interpolation of ``version``; True if a calibrator sets lambda.

        Builds a new :class:`ServedInterpolation` and replaces ``served`` in one assignment
        (only when a file changed: ``reload_index`` calls this often).
        """
        from memlm.calibrator.constant import INTERPOLATION_FILE, load_choice
        from memlm.calibrator.lexical import LexicalStats

        root = Path(index_root)
        found = saved_versions(root, CALIBRATOR_DIR)
        usable = [v for v in found if version is not None and v <= version]
        cal_v = max(usable) if usable else None
        vdir = None if cal_v is None else root / f"v{cal_v:06d}"
        choice = load_choice(root, version)
        cal_stamp = (
            None
            if vdir is None
            else (str(vdir), (vdir / CALIBRATOR_DIR / "calibrator.json").stat().st_mtime_ns)
        )
        choice_stamp = (
            None
            if choice is None
            else (choice[0], (root / f"v{choice[0]:06d}" / INTERPOLATION_FILE).stat().st_mtime_ns)
        )
        ev = evidence_files.load(root, version) if self.use_evidence else None
        ev_stamp = None if ev is None else (ev[0], ev[1])
        stamp = (version, cal_stamp, choice_stamp, ev_stamp, self.default)
        if stamp == self._loaded:
            return self.calibrator is not None
        old = self.served
        cal = gate = None
        lexical = self.lexical
        if vdir is not None:
            if self._loaded is not None and self._loaded[1] == cal_stamp:
                cal, gate, lexical = old.calibrator, old.gate, old.lexical or self.lexical
            else:
                cal = Calibrator.load(vdir / CALIBRATOR_DIR)
                gate_dir = vdir / GATE_DIR
                gate = (
                    Calibrator.load(gate_dir) if (gate_dir / "calibrator.json").exists() else None
                )
                lex = vdir / "lexical.npz"
                lexical = LexicalStats.load(lex, self.vocab_size) if lex.exists() else self.lexical
        record: dict[str, Any] = {} if choice is None else choice[1]
        if record:
            params = KnnParams(
                k=int(record["k"]),
                temperature=float(record["temperature"]),
                lmbda=float(record["lambda"]),
            )
            # the calibrator beat the constant (or joined the evidence): only the very one
            # it was compared with
            compared = (record.get("calibrator") or {}).get("calibrator_version")
            wanted = "combined" if self.use_evidence else "calibrator"
            use = bool(record.get("lambda_source") == wanted and compared == cal_v)
        else:  # a data directory from before the choice was recorded: as it served then
            params, use = self.default, cal is not None and not self.use_evidence
        model = None
        if self.use_evidence:
            model = PRIOR if ev is None else ev[1]
            if ev is not None:  # k and T the evidence was fitted with (memlm.calibrator.combined)
                params = replace(params, k=int(ev[2]["k"]), temperature=float(ev[2]["temperature"]))
        combined = ((record.get("evidence") or {}).get("combined")) or {}
        cal_t = combined.get("calibrator_temperature", record.get("temperature"))
        self.served = ServedInterpolation(
            params=params,
            version=version,
            record=record,
            calibrator_temperature=None if cal_t is None else float(cal_t),
            calibrator=cal,
            calibrator_version=cal_v,
            use_calibrator=use,
            gate=gate,
            theta=old.theta,
            lexical=lexical,
            evidence=model,
        )
        self._loaded = stamp
        return self.calibrator is not None

    # --- the served interpolation of a build ---------------------------------------------

    def choose_constant(self, grid: TuneGrid, *, min_tokens: int | None = None) -> ConstantChoice:
        """Tune the constant (k, T, lambda) on every held-out token merged so far."""
        from memlm.calibrator.constant import MIN_TUNE_TOKENS, choose_constant

        return choose_constant(
            self.training_rows(),
            grid,
            self.default,
            min_tokens=MIN_TUNE_TOKENS if min_tokens is None else min_tokens,
        )

    def compare(self, params: KnnParams, index_root: Path, version: int) -> dict[str, Any] | None:
        """:func:`memlm.calibrator.retrain.compare` on the tokens merged so far."""
        return build_time.compare(self.training_rows(), params, index_root, version)

    def choose(
        self,
        choice: ConstantChoice,
        grid: TuneGrid,
        index_root: Path,
        version: int,
    ) -> dict[str, Any]:
        """:func:`memlm.calibrator.retrain.choose` on the tokens merged so far."""
        return build_time.choose(
            self.training_rows(), choice, grid, index_root, version, evidence=self.use_evidence
        )

    # --- the training set (:class:`HeldoutSet`) -------------------------------------------

    def training_rows(self) -> dict[str, np.ndarray]:
        """Every held-out token merged so far (empty dict when none)."""
        return self.heldout.rows()

    def training_index(self) -> tuple[set[int], dict[int, int]]:
        """The stream documents in the training set and its tokens per day."""
        return self.heldout.index()

    def add_heldout(
        self, split: dict[str, np.ndarray], version: int, *, max_tokens: int | None = None
    ) -> int:
        """Merge held-out tokens into the training set for ``version`` (:meth:`HeldoutSet.add`)."""
        return self.heldout.add(split, version, max_tokens=max_tokens)

    def drop_document(self, doc_id: int) -> int:
        """Remove a forgotten document's rows from the training set; returns how many."""
        return self.heldout.drop_document(doc_id)

    # --- training (:mod:`memlm.calibrator.retrain`) -----------------------------------------

    def train(
        self,
        split: dict[str, np.ndarray],
        params: KnnParams,
        index_root: Path,
        version: int,
        cfg: CalibratorConfig | None = None,
        gate: CalibratorConfig | None = None,
    ) -> dict[str, Any]:
        """Add held-out tokens (EvalTokens-like arrays), retrain both models, save for version."""
        self.add_heldout(split, version)
        return self.retrain(params, index_root, version, cfg=cfg, gate=gate)

    def retrain(
        self,
        params: KnnParams,
        index_root: Path,
        version: int,
        *,
        min_tokens: int = 1,
        cfg: CalibratorConfig | None = None,
        gate: CalibratorConfig | None = None,
    ) -> dict[str, Any]:
        """Train the calibrator and the gate for ``version`` on the tokens merged so far
        (:func:`memlm.calibrator.retrain.retrain`)."""
        return build_time.retrain(
            self.training_rows(),
            params,
            index_root,
            version,
            min_tokens=min_tokens,
            cfg=cfg,
            gate=gate,
        )

    def _carry_forward(self, root: Path, version: int) -> int | None:
        """Copy the newest earlier calibrator and gate beside ``version``; their version."""
        return build_time.carry_forward(root, version)
