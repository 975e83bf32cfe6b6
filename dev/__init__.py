"""The lab beside the package (llm.c's dev/): models and scripts the wheel does not ship."""
