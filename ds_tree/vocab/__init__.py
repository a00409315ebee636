"""The project's own tokenizer and what goes with it: the byte-level BPE tokenizer ``ds-tree make-tokenizer``
builds (``tokenizer.py``), each model family's chat template written here (``chat_templates.py``), and the
processor folders of the vision-language families (``vision_processor.py``). Nothing here is downloaded."""
