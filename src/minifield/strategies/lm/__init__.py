"""What the language-model strategies share: the recipe's model section, the program, the export format."""
