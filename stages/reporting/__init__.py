"""What the report is made of: its narrow tables in human units and its plots."""
