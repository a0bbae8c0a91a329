"""What an export's model card shows: the card's text (card.py), its plots (plots.py: healing curves
and KL by stage; provenance_plots.py: the analysis figures a run's steps already measured), the
analysis figures themselves (figures.py) and the one matplotlib setup they share (canvas.py)."""
