"""``PrivateSFTTrainer``: TRL's ``SFTTrainer`` with dpl's private step (:class:`dpl.hf.trainer.PrivateTrainerMixin`).

TRL prepares the data as usual (chat templates, ``completion_only_loss``, ``assistant_only_loss``: its masks become
the ``-100`` labels the per-example loss skips); dpl refuses ``packing`` and ``padding_free``, which put several
examples in one row (:mod:`dpl.hf.checks`).
"""

from __future__ import annotations

from trl import SFTTrainer

from dpl.hf.trainer import PrivateTrainerMixin


class PrivateSFTTrainer(PrivateTrainerMixin, SFTTrainer):
    """``trl.SFTTrainer`` with dpl's private step::

        trainer = PrivateSFTTrainer(model=model, args=SFTConfig(...), train_dataset=conversations,
                                    processing_class=tokenizer, privacy=PrivacyConfig(target_epsilon=8, batch_size=64))
        trainer.train()
    """
