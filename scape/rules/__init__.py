"""Rules for a sparse step: what the owner does with the synchronized compact gradient, and
which statistic picks the next mask.

A rule is a :class:`Rule`. ``update=`` of :class:`scape.SCAPE` names one in :data:`RULES`:

==========  ===========================================================================
``agree``   the default: each block sends the coordinates whose update is expected to lower
            the loss most (the owner's own gradient statistics, :func:`gain_score`); a
            sent coordinate moves for the steps it waited as far as the ranks' gradients
            agreed in sign, at most :data:`TRUST` of its block's RMS (16 B/coordinate)
``sqrt``    masks by accumulated mass ``|m| (age + 1)``, a sent coordinate moves
            ``sqrt(age + 1)`` steps (:func:`catchup_sqrt`): no extra state, less compute
``lazy``    the paper's baseline (DESIGN §1): a sent coordinate takes one AdamS step, the
            rest wait
==========  ===========================================================================

Other rules plug in with :func:`register` (``bench/research/rules.py`` registers its own).
Every name below is importable from ``scape.rules``; each lives in the module named for it:

=================================  ===========================================================
:mod:`scape.rules.rule`            :class:`Rule` and the types of its functions (``UpdateFn``,
                                   ``ScoreFn``, ``ObserveFn``)
:mod:`scape.rules.state`           :class:`ShardState`, and the lr counters checkpoints save
                                   (:func:`lr_counters`, :func:`load_lr_counters`)
:mod:`scape.rules.registry`        :data:`RULES`, :data:`BUILTIN`, :func:`register`, :func:`get`
:mod:`scape.rules.budget`          :func:`block_budget`, :func:`round_half_up`,
                                   :func:`reads_wait`
:mod:`scape.rules.estimators`      the owner's local statistics and the scores read from them
                                   (:func:`observe_local_moments`, :func:`gain_score`,
                                   :func:`gain_select`, ...)
:mod:`scape.rules.catchups`        the catch-ups (``update`` functions) and the pieces they
                                   are built of (:func:`catchup_agree`, :func:`arrived_mean`, ...)
:mod:`scape.rules.builtin`         the built-in rules, the default's constants
                                   (:data:`CONSTANTS`, :data:`TRUST`, ...) and constructors
                                   (:func:`gain_selected`, ...)
=================================  ===========================================================

``update(shard, g, idx, block_size, hp, model_out)``:

- ``shard``: the owner's :class:`ShardState` (fp32 ``master``, fp32 ``m``, int32 ``age`` over
  the whole shard, plus ``extra`` tensors a rule may keep);
- ``g``: the averaged gradient at the mask coordinates (fp32, compact, ``n_blocks * k``). With
  error feedback it is everything accumulated there since the coordinate was last sent;
- ``idx``: the owner's mask, int16 ``[n_blocks, k]`` block-local offsets;
- ``hp``: ``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay`` of the param group and the
  ``world`` size;
- ``model_out``: compact buffer (model dtype) that must receive the new parameter values at
  the mask coordinates; it is all-gathered and scattered into every rank's model.

It must set ``age = 0`` at the mask and ``age += 1`` elsewhere. Only the mask coordinates are
sent, so a rule may change other coordinates of ``master`` only if every rank can reproduce
that change (otherwise the ranks' models drift apart).

``score(shard) -> Tensor`` (length S): the next mask takes, per block, the largest ``|score|``
(default: the first moment ``m``, DESIGN §1 step 4), and a fraction ``explore`` of each
block's budget by age. A rule with ``score_reads_hp`` gets the hyperparameters and the mask's
budget too: ``score(shard, hp)``, ``hp["k"]`` of ``hp["block_size"]``. A rule with ``select``
makes that mask itself, score and selection fused (:func:`scape.kernels.gain_topk`).

Optional seams, each free of communication: ``observe(shard, buf, error_feedback)`` sees the
owner's slice of its own gradient buffer at the start of every step (local statistics, kept
in the shard tensors named by ``extra``, which checkpoints save and reshard); ``reset(shard)``
runs after a skipped step, whose residuals were cleared.
"""

from scape.rules.budget import block_budget, reads_wait, round_half_up
from scape.rules.builtin import (
    CONSTANTS,
    GAIN_SCORES,
    STEADY_BETA,
    TRUST,
    gain_selected,
    noise_sized,
    observe_select_gain,
    trust_bound,
)
from scape.rules.catchups import (
    arrived_mean,
    catchup_agree,
    catchup_mean,
    catchup_snr,
    catchup_sqrt,
    lazy,
    mask_positions,
    move_selected,
    sign_agreement,
    trust_reach,
)
from scape.rules.estimators import (
    GAIN_STATE,
    NOISE_BETA,
    NOISE_STATE,
    accumulated_score,
    gain_score,
    gain_score_residual,
    gain_select,
    observe_local_moments,
    observe_local_noise,
    reset_local_noise,
    unadvance_ages,
)
from scape.rules.registry import BUILTIN, RULES, get, register
from scape.rules.rule import ObserveFn, Rule, ScoreFn, UpdateFn
from scape.rules.state import ShardState, load_lr_counters, lr_counters

__all__ = [
    # the rule and its state
    "Rule", "UpdateFn", "ScoreFn", "ObserveFn", "ShardState", "lr_counters",
    "load_lr_counters",
    # the registry
    "RULES", "BUILTIN", "register", "get",
    # budgets
    "block_budget", "round_half_up", "reads_wait",
    # estimators and scores
    "NOISE_BETA", "NOISE_STATE", "GAIN_STATE", "accumulated_score", "observe_local_noise",
    "reset_local_noise", "observe_local_moments", "gain_score", "gain_score_residual",
    "gain_select", "unadvance_ages",
    # catch-ups
    "lazy", "catchup_mean", "catchup_sqrt", "catchup_snr", "catchup_agree", "mask_positions",
    "move_selected", "arrived_mean", "sign_agreement", "trust_reach",
    # the built-in rules' pieces and constants
    "GAIN_SCORES", "observe_select_gain", "noise_sized", "gain_selected", "CONSTANTS",
    "STEADY_BETA", "TRUST", "trust_bound",
]
