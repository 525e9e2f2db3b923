"""Draft heads, the target model loader and their save/load/export formats."""
