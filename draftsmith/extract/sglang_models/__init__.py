"""SGLANG_EXTERNAL_MODEL_PACKAGE for draftsmith's capture servers (see extract/sglang_dump.py).

SGLang imports every module of this package and registers the classes in its `EntryClass`,
overriding its own class of the same name. Only capture servers set the variable.
"""
