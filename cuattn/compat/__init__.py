"""Drop-in fits for other libraries' attention APIs: ``transformers`` (an attention
implementation for Hugging Face models) and ``deepspeed`` (DeepSpeed's sparse-attention API).
Each imports its library (torch, transformers) only when imported itself."""
