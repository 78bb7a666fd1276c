"""A trained reward model as a reward: a sequence classifier with one label scores each completion.

:class:`RewardModel` loads (or takes) an ``AutoModelForSequenceClassification`` with one output,
formats what the policy saw (the conversation through the reward model's chat template when it has
one, else the prompt's text followed directly by the completion, no separator), truncates from the
left at ``max_length``, and scores in batches under ``torch.no_grad()`` in eval mode and its dtype.
The module tells it where the policy lives and which system message the policy got
(:class:`PolicyContext`, handed to every reward with a ``use_policy_context`` method); it is a plain
attribute of the reward, not an ``nn.Module`` of the LightningModule, so it is in no ``state_dict``,
optimizer or DDP wrapper, and each rank holds its own whole copy (under FSDP too: only the policy
is sharded; the reward model is not, so it must fit on one device beside its shard). A Lightning
checkpoint stores its spec (the reward's ``init_args``) and, for a folder, fingerprints of its
weights and of what formats its input (chat template, tokenizer files, config; ``run/checkpoint_io.py``):
resuming with a changed folder is refused, naming what changed.

Pooling. A decoder classifier with a ``score`` head (Llama, Qwen, Mistral, GPT-2, ... in
transformers) is read at the last token of each text, batches left-padded with their positions
counted from the first real token: transformers' own pooling takes the last token that is not the
pad id, which skips a real final EOS when the pad token is the EOS. Any other classifier is called
as it is, on right-padded batches, with its own pooling.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from forge_lightning.models.loading import EMBEDDED, ModelLoadError, _embedded_cache, ensure_pad_token
from forge_lightning.rewards.calls import BaseReward, RewardOutput
from forge_lightning.rewards.setting import is_causal_lm
from forge_lightning.rollout.types import left_pad, left_padded_positions
from forge_lightning.run.fileio import folder_fingerprint


@dataclass(frozen=True)
class PolicyContext:
    """What a reward may need to know of the policy: its device and the system message its prompts
    carried (None: none)."""

    device: torch.device
    system_prompt: str | None = None


class RewardModel(BaseReward):
    """Scores each completion with a trained reward model (a sequence classifier, one label).

    Args:
        model: a spec (a folder written by ``save_pretrained``, a hub id; offline a hub id needs
            the HF cache) or a built ``PreTrainedModel`` with ``num_labels == 1``. A model whose
            score head is not in its weights (a causal LM such as ``embedded``, ``random:``
            weights) is refused: it would score with a random head.
        tokenizer: required with a built model; loaded with a spec.
        batch_size: texts per forward pass.
        max_length: longest text in tokens; longer ones lose their first tokens (the prompt's
            start), with a warning that counts them.
        dtype: the reward model's weights' dtype (``float32``, ``bfloat16``, ...).
        device: where it runs; None: the policy's device, from fit (or validate) start.
        use_chat_template: format through the reward model's chat template (the policy's
            conversation, its system message included, then the completion as the assistant
            turn); None: when its tokenizer has one. Without: prompt text + completion.
        normalize: ``"batch"``: z-score each scored batch, ``(s - mean) / (std + 1e-6)`` over the
            batch (population std), applied after scoring (rewards/batch_scoring.py), outside the call;
            None: raw.
    """

    in_process = True  # its model stays in the trainer's process under sandbox: process

    def __init__(
        self,
        model: str | PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        batch_size: int = 16,
        max_length: int = 1024,
        dtype: str = "float32",
        device: str | None = None,
        use_chat_template: bool | None = None,
        normalize: Literal["batch"] | None = None,
    ) -> None:
        if batch_size < 1 or max_length < 2:
            raise ValueError(
                f"RewardModel needs batch_size >= 1 and max_length >= 2, got {batch_size=}, {max_length=}"
            )
        if normalize not in (None, "batch"):
            raise ValueError(f"RewardModel normalize must be None or 'batch', got {normalize!r}")
        self.model, self.tokenizer = model, tokenizer  # as given: what a checkpoint stores
        self.batch_size, self.max_length, self.dtype = batch_size, max_length, dtype
        self.device, self.use_chat_template, self.normalize = device, use_chat_template, normalize
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"RewardModel dtype must name a torch dtype (float32, bfloat16), got {dtype!r}")
        self.classifier, self._tokenizer = _classifier(model, tokenizer, getattr(torch, dtype))
        self.folder = Path(model) if isinstance(model, str) and Path(model).is_dir() else None
        self.system_prompt: str | None = None
        # SHA-256 of the folder's weight files as loaded (None for a hub id or a built model), and
        # of the files that format its input; checkpoints record them, a resume compares a fresh load's.
        self.fingerprint = folder_fingerprint(self.folder) if self.folder is not None else None
        self.file_fingerprints = (
            formatting_fingerprints(self.folder, self._tokenizer) if self.folder is not None else {}
        )
        if device is not None:
            self.classifier.to(device)

    def use_policy_context(self, context: PolicyContext) -> None:
        """Take the policy's system message, and its device unless ``device`` was set."""
        self.system_prompt = context.system_prompt
        if self.device is None:
            self.classifier.to(context.device)

    def __call__(self, prompts: list[Any], responses: list[str], **kwargs: Any) -> RewardOutput:
        texts = [self.format(p, r) for p, r in zip(prompts, responses)]
        scores: list[float] = []
        cut = 0
        device = next(self.classifier.parameters()).device
        self.classifier.eval()
        # In its own dtype: a mixed-precision fit's autocast (thread-local, like no_grad) is off here.
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            for start in range(0, len(texts), self.batch_size):
                batch, shortened = self._encode(texts[start : start + self.batch_size])
                scores += self._forward(batch)
                cut += shortened
        if cut:
            warnings.warn(
                f"RewardModel: {cut} of {len(texts)} texts were longer than max_length={self.max_length} "
                "tokens and lost their first tokens",
                stacklevel=2,
            )
        return RewardOutput(scores=scores)

    def format(self, prompt: Any, response: str) -> str:
        """The text the reward model reads for one completion."""
        from forge_lightning.rollout.sampler import prompt_messages, prompt_text

        if self._chat_template:
            messages = [
                *prompt_messages(prompt, self.system_prompt),
                {"role": "assistant", "content": response},
            ]
            return self._tokenizer.apply_chat_template(messages, tokenize=False)
        return prompt_text(prompt) + response

    @property
    def _chat_template(self) -> bool:
        if self.use_chat_template is not None:
            return self.use_chat_template
        return bool(getattr(self._tokenizer, "chat_template", None))

    def _encode(self, texts: list[str]) -> tuple[list[list[int]], int]:
        """Token ids of each text, the longest kept to their last ``max_length``; and how many were cut."""
        ids = self._tokenizer(texts, add_special_tokens=not self._chat_template)["input_ids"]
        shortened = sum(len(row) > self.max_length for row in ids)
        return [row[-self.max_length :] for row in ids], shortened

    def _forward(self, rows: list[list[int]]) -> list[float]:
        model = self.classifier
        device = next(model.parameters()).device
        pad = self._tokenizer.pad_token_id
        head = getattr(model, "score", None)
        if head is not None:  # our own last-token pooling (module docstring)
            ids, mask = (t.to(device) for t in left_pad(rows, pad))
            hidden = model.base_model(
                input_ids=ids, attention_mask=mask, position_ids=left_padded_positions(mask)
            )
            logits = head(hidden.last_hidden_state[:, -1])  # (B, 1)
        else:
            ids = pad_sequence([torch.tensor(row) for row in rows], batch_first=True, padding_value=pad)
            mask = pad_sequence([torch.ones(len(row), dtype=torch.long) for row in rows], batch_first=True)
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits  # (B, 1)
        scores = logits[:, 0].float().tolist()
        if not all(math.isfinite(s) for s in scores):
            raise ValueError("RewardModel produced a score that is not finite (NaN or inf)")
        return scores


def batch_zscore(scores: Sequence[float]) -> list[float]:
    """``(s - mean) / (std + 1e-6)`` over the batch (population std): a batch's normalised scores."""
    mean = sum(scores) / len(scores)
    std = math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores))
    return [(s - mean) / (std + 1e-6) for s in scores]


def _classifier(
    model: str | PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The classifier (frozen, eval mode, in ``dtype``) and its tokenizer, checked."""
    if isinstance(model, str):
        model, tokenizer = _load(model, dtype)
        name = model.name_or_path
    else:
        if tokenizer is None:
            raise ValueError("RewardModel: a built model needs its tokenizer= too")
        name = type(model).__name__
        model = model.to(dtype)
    labels = getattr(model.config, "num_labels", None)
    if labels != 1:
        raise ValueError(
            f"RewardModel: {name} has num_labels={labels}; a reward model gives one score per text "
            "(num_labels=1)"
        )
    model.eval().requires_grad_(False)
    return model, ensure_pad_token(tokenizer)  # batches are padded


def _load(spec: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if spec.startswith("random:") or spec.endswith(".gguf"):
        raise ValueError(
            f"RewardModel: {spec!r} has no trained score head (random weights, or a GGUF causal LM); "
            "give a folder or hub id of a sequence classifier with one label"
        )
    _refuse_missing_folder(spec)
    if Path(spec).expanduser().is_dir() and is_causal_lm(Path(spec).expanduser()):
        raise ValueError(f"RewardModel: {spec!r} is a causal LM (a policy), not {_WANTED}")
    source = _embedded_cache() if spec == EMBEDDED else spec
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            source, dtype=dtype, output_loading_info=True
        )
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"RewardModel could not load {spec!r} as a sequence classifier: {err}. Offline, pass a "
            "folder written by save_pretrained"
        ) from err
    missing = [key for key in info.get("missing_keys", []) if key.split(".")[0] in ("score", "classifier")]
    if missing:
        raise ValueError(
            f"RewardModel: {spec!r} has no trained score head (its weights lack "
            f"{', '.join(sorted(missing))}, which would start random): it is a causal LM or a base "
            f"model, not {_WANTED}"
        )
    return model, tokenizer


# What RewardModel takes, and what scores with a causal LM instead: said where a model is refused.
_WANTED = (
    "a sequence classifier: give a model with a trained classification head and one label "
    "(AutoModelForSequenceClassification, num_labels=1), or have a causal LM judge each completion "
    "with JudgeReward(model=..., template=...)"
)


def _refuse_missing_folder(spec: str) -> None:
    """FileNotFoundError where ``spec`` reads as a local path (it starts with ``.``, ``/`` or
    ``~``, has more parts than a hub id's ``namespace/name``, or its first part exists here) that
    does not exist; transformers would call it a malformed repo id."""
    path = Path(spec).expanduser()
    parts = Path(spec).parts
    local = spec.startswith((".", "/", "~", os.sep)) or len(parts) > 2
    if path.exists() or not (local or (len(parts) > 1 and Path(parts[0]).exists())):
        return
    found = next(str(parent) for parent in path.parents if parent.exists())
    raise FileNotFoundError(
        f"RewardModel: the folder {spec!r} does not exist ({found!r} does); give a folder written "
        "by save_pretrained, or a hub id (namespace/name)"
    )


# A folder's files besides the weights that change its scores, by the name a refused resume gives
# them. tokenizer_config.json is split: its chat_template key (where older transformers wrote the
# template) belongs to the template, the rest to the tokenizer.
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
_TOKENIZER_FILES = (
    "tokenizer.json", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
    "vocab.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
)  # fmt: skip


def formatting_fingerprints(folder: Path, tokenizer: Any = None) -> dict[str, str]:
    """SHA-256 of what in ``folder`` formats and reads a text besides the weights: ``config``
    (config.json), ``tokenizer`` (its files, also those ``tokenizer``'s class names) and ``chat
    template``; a file removed or added changes its part too."""
    settings = _json_file(folder / "tokenizer_config.json")
    template = settings.pop("chat_template", None) if isinstance(settings, dict) else None
    extra = tuple(getattr(tokenizer, "vocab_files_names", {}).values())
    templates = [folder / name for name in _TEMPLATE_FILES]
    templates += sorted((folder / "additional_chat_templates").glob("*"))
    return {
        "config": _digest([folder / "config.json"]),
        "tokenizer": _digest([folder / name for name in dict.fromkeys(_TOKENIZER_FILES + extra)], settings),
        "chat template": _digest(templates, template),
    }


def _json_file(path: Path) -> Any:
    """The file's JSON, its text where it is not JSON, None where it does not exist."""
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _digest(paths: list[Path], value: Any = None) -> str:
    """SHA-256 over the names and bytes of those ``paths`` that exist, and ``value`` as JSON."""
    digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode() + b"\0")
    for path in paths:
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def reward_model_fingerprints(parts: Sequence[Any]) -> list[dict[str, Any]]:
    """Folder, weights fingerprint and formatting fingerprints (:func:`formatting_fingerprints`)
    of each reward among ``parts`` that runs a model loaded from a folder (a RewardModel, a local
    JudgeReward: its ``folder``, ``fingerprint`` and ``file_fingerprints``), for the Lightning
    checkpoint (the weights themselves are not saved there)."""
    return [
        {"folder": str(part.folder), "fingerprint": part.fingerprint, "files": dict(part.file_fingerprints)}
        for part in parts
        if getattr(part, "folder", None) is not None and hasattr(part, "file_fingerprints")
    ]


def check_reward_models(saved: list[dict[str, Any]], parts: Sequence[Any]) -> None:
    """Refuse a resume whose reward model folders score otherwise than those the checkpoint
    recorded: other weights, config, tokenizer or chat template. A checkpoint written before the
    formatting was fingerprinted has the weights' alone, which are all that can be compared."""
    for before, now in zip(saved, reward_model_fingerprints(parts)):
        changed = ["weights"] if before["fingerprint"] != now["fingerprint"] else []
        recorded = before.get("files")
        if recorded is not None:
            changed += [name for name, value in now["files"].items() if recorded.get(name) != value]
        if changed:
            raise RuntimeError(
                f"the reward model in {now['folder']} is not the one this run was trained with: its "
                f"{', '.join(changed)} changed since the checkpoint (folder {before['folder']}), "
                "which changes its scores. Restore that reward model's folder, or start a new run"
            )
