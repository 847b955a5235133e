"""What a job reads as input: the tokenizer and the data files, opened as the job will open them
(``torchtitan_common.job_inputs``, which the 0.3 adapter calls too), with this job's values.

* The tokenizer of ``model.hf_assets_path`` (any dataset but the synthetic ones): present,
  loadable, no larger than the model's embedding, an EOS token for a ``block_causal`` flavor.
* ``training.dataset = "local_text"``: every ``local_data.paths`` pattern's files, their first
  records read as the loader reads them; likewise ``validation.dataset_path``.
"""

from __future__ import annotations

from titan_upipe.data.synthetic import SYNTHETIC_DATASETS
from titan_upipe.errors import ConfigError
from titan_upipe.torchtitan_0_2.flavors import flavor_args, packs_documents
from titan_upipe.torchtitan_0_2.job_assets.model_state import job_model_state
from titan_upipe.torchtitan_common import job_inputs


def download_hint(job_config, folder: str) -> str:
    return job_inputs.download_hint(job_config.model.name, job_config.model.flavor, folder)


def _packs_documents(job_config) -> bool:
    try:
        return packs_documents(flavor_args(job_config, update=False))
    except ConfigError:  # an unknown model or flavor: the job checks name it
        return False


def check_tokenizer(job_config) -> None:
    if job_config.training.dataset in SYNTHETIC_DATASETS:  # their own tokenizer: no model state needed
        return
    model = job_model_state(job_config)
    job_inputs.check_tokenizer(job_config.training.dataset, job_config.model.hf_assets_path,
                               model_name=job_config.model.name, flavor=job_config.model.flavor,
                               documents=_packs_documents(job_config), vocab_size=model.vocab_size if model else None)


def check_dataset(job_config) -> None:
    validation = job_config.validation
    job_inputs.check_dataset(job_config.training.dataset, job_config.local_data,
                             validation.dataset if validation.enable else None, validation.dataset_path)
