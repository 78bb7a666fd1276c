"""forge_lightning data: GSM8K loading, prompt formatting and the datamodule (PromptDataModule,
first named GSM8KDataModule: it loads GSM8K by default, and any prompt dataset)."""

from forge_lightning.data.datamodule import (
    EpochShuffleSampler,
    GSM8KDataModule,
    PromptDataModule,
    collate_records,
)
from forge_lightning.data.gsm8k import (
    extract_answer,
    format_prompt,
    load_gsm8k,
    load_gsm8k_mock,
    normalize_number,
    parse_reference,
)

__all__ = [
    "EpochShuffleSampler",
    "GSM8KDataModule",
    "PromptDataModule",
    "collate_records",
    "extract_answer",
    "format_prompt",
    "load_gsm8k",
    "load_gsm8k_mock",
    "normalize_number",
    "parse_reference",
]
